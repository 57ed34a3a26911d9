"""Hand recipes for the real-text workload (benchmarks/text/workload.py), and the run that checks and
times them: what an expert writes by hand for a sentence encoder on a CPU.

Each recipe takes the model (for ONNX Runtime, its session) and a list of samples, and returns
``(embeddings, seconds)``: (n, 384) float32 in the samples' order, and the wall time of the
whole pass (collate, trim, sort and restore included). The baseline is float32 eager at batch
32 over the pre-padded dataset (every sentence padded to 64 tokens); the others batch the same
sentences at their natural lengths, padded per batch by ``pad_collate``:

    fp32_padded     the baseline
    fp32_trimmed    batches in input order, each padded only to its own longest sentence
    fp32_sorted     batches of similar lengths (sorted by length), results put back in order
    bf16_padded     bf16 autocast, padded; bf16_sorted: bf16 autocast, sorted
    ort_sorted      ONNX Runtime, sorted, on a session of ``ort_session(path)``: float32 from
                    ``export_onnx(model, path)``, or int8 from ``quantize_int8(fp32_path, path)``
                    (dynamic: int8 weights, activations quantized per batch)

``int8_sensitivity`` quantizes one weight MatMul at a time and ranks them by the damage done.

The run (:func:`run`) checks every recipe against the baseline's embeddings, then times them:

    python -m benchmarks.text                  # 384 sentences: correctness, then speed
    python -m benchmarks.text --quick          # 64 sentences, 2 rounds
    python -m benchmarks.text --sensitivity    # also: int8 one MatMul at a time

Example (needs the weights):

    model, samples = minilm(), dataset(64)
    emb, seconds = fp32_sorted(model, samples)
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.text.workload import HIDDEN, pad_collate

BATCH_SIZE = 32
Samples = list[dict[str, torch.Tensor]]


def encode(
    forward: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    samples: Samples,
    *,
    batch_size: int = BATCH_SIZE,
    trim: bool = True,
    sort: bool = True,
) -> tuple[torch.Tensor, float]:
    """The loop every recipe shares: ``forward`` over batches of ``samples``.

    Args:
        trim: Cut each batch's columns that are padding in every row, so pre-padded samples
            run at their batch's longest length too.
        sort: Batch the samples in order of length (so a batch's sentences pad little) and
            put the embeddings back in the samples' order.
    """
    started = time.perf_counter()
    n = len(samples)
    order = list(range(n))
    if sort:  # stable: equal lengths keep their order, so the batches are the same every run
        order.sort(key=lambda i: int(samples[i]["attention_mask"].sum()))
    out = torch.empty(n, HIDDEN)
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            index = order[start : start + batch_size]
            batch = pad_collate([samples[i] for i in index])  # (B, T_max) each
            if trim:
                longest = int(batch["attention_mask"].sum(1).max())
                batch = {k: v[:, :longest] for k, v in batch.items()}
            out[index] = forward(batch).float()
    return out, time.perf_counter() - started


def _eager(model: torch.nn.Module, bf16: bool) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(**batch)

    return forward


def fp32_padded(model: torch.nn.Module, samples: Samples) -> tuple[torch.Tensor, float]:
    """Float32 eager, every batch as long as its samples are (64 for the pre-padded dataset)."""
    return encode(_eager(model, False), samples, trim=False, sort=False)


def fp32_trimmed(model: torch.nn.Module, samples: Samples) -> tuple[torch.Tensor, float]:
    """Float32 eager, batches in input order, each trimmed to its longest sentence."""
    return encode(_eager(model, False), samples, trim=True, sort=False)


def fp32_sorted(model: torch.nn.Module, samples: Samples) -> tuple[torch.Tensor, float]:
    """Float32 eager, trimmed batches of similar lengths, outputs back in input order."""
    return encode(_eager(model, False), samples, trim=True, sort=True)


def bf16_padded(model: torch.nn.Module, samples: Samples) -> tuple[torch.Tensor, float]:
    """bf16 autocast (matmuls in bf16, LayerNorm and softmax in float32), padded batches."""
    return encode(_eager(model, True), samples, trim=False, sort=False)


def bf16_sorted(model: torch.nn.Module, samples: Samples) -> tuple[torch.Tensor, float]:
    """bf16 autocast, trimmed and length-sorted batches."""
    return encode(_eager(model, True), samples, trim=True, sort=True)


def ort_sorted(session: Any, samples: Samples) -> tuple[torch.Tensor, float]:
    """An ONNX Runtime session of :func:`ort_session`, trimmed and length-sorted batches."""

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {k: v.numpy() for k, v in batch.items()})[0])

    return encode(forward, samples, trim=True, sort=True)


def bf16_skip_reason() -> str | None:
    """Why bf16 autocast is not worth timing here, or ``None`` where the CPU has native bf16
    (AVX512-BF16 or AMX): elsewhere oneDNN emulates it, slower than float32."""
    from autotune.env import cpu_info

    native = {"avx512_bf16", "amx_bf16"} & set(cpu_info()["isa"])
    if native:
        return None
    return f"no native bf16 on this CPU ({torch.backends.cpu.get_cpu_capability()}, neither avx512_bf16 nor amx_bf16)"


# -----------------------------------------------------------------------------
# ONNX Runtime


def export_onnx(model: torch.nn.Module, path: Path, *, dynamo: bool = True) -> Path:
    """``model`` as one ONNX file (weights inside), batch and sequence axes dynamic.

    Inputs ``input_ids`` and ``attention_mask``, int64 (batch, seq); output
    ``sentence_embedding`` (batch, 384). ``dynamo=False``: the TorchScript exporter, which torch
    deprecates but still ships; it names nodes by module (``/layers.0/query/MatMul``).
    """
    example = pad_collate(
        [{"input_ids": torch.tensor([101, 7592, 102]), "attention_mask": torch.ones(3, dtype=torch.int64)}] * 2
    )
    args, names = (example["input_ids"], example["attention_mask"]), ["input_ids", "attention_mask"]
    if dynamo:
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=512)
        options: dict[str, Any] = {"dynamic_shapes": {n: {0: batch, 1: seq} for n in names}, "external_data": False}
    else:
        axes = {n: {0: "batch", 1: "seq"} for n in names}
        options = {"dynamic_axes": {**axes, "sentence_embedding": {0: "batch"}}, "opset_version": 17}
    # Not "embedding": the dynamo exporter names aten.embedding's output so, a duplicate name.
    # Quiet: its progress lines, a deprecation per call and a line per missing torchvision op
    # say nothing about this model; a failure still raises.
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model, args, str(path), input_names=names, output_names=["sentence_embedding"], dynamo=dynamo, **options
            )
    finally:
        exporter_log.setLevel(level)
    return path


class _NoPreprocessHint(logging.Filter):
    """Drops quantize_dynamic's advice to pre-process first: that is for static quantization."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def quantize_int8(
    fp32_path: Path,
    path: Path,
    *,
    per_channel: bool = False,
    nodes_to_exclude: Sequence[str] = (),
    nodes_to_quantize: Sequence[str] | None = None,
) -> Path:
    """ONNX Runtime's dynamic int8 of the MatMuls with a constant weight: weights QInt8 (per
    tensor unless ``per_channel``), activations quantized per batch; all of those MatMuls, or
    ``nodes_to_quantize`` only, but never those in ``nodes_to_exclude``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    hint = _NoPreprocessHint()
    logging.getLogger().addFilter(hint)
    try:
        quantize_dynamic(
            fp32_path,
            path,
            op_types_to_quantize=["MatMul"],
            per_channel=per_channel,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(nodes_to_exclude),
            nodes_to_quantize=list(nodes_to_quantize) if nodes_to_quantize is not None else None,
        )
    finally:
        logging.getLogger().removeFilter(hint)
    return path


def ort_session(path: Path) -> Any:
    """A CPU session on as many threads as torch uses, so the two compare on equal cores."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def weight_matmuls(path: Path) -> dict[str, str]:
    """The MatMuls with a constant weight, node name -> the module it came from
    (``layers.0.query``, which the dynamo exporter records in the node's name scopes; the node's
    own name where there are none)."""
    import onnx

    graph = onnx.load(str(path)).graph
    weights = {i.name for i in graph.initializer}
    found = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in weights:
            scopes = {p.key: p.value for p in node.metadata_props}.get("pkg.torch.onnx.name_scopes")
            # "['', 'layers.0', 'layers.0.query', 'linear']": the module, then the aten op
            found[node.name] = ast.literal_eval(scopes)[-2] if scopes else node.name
    return found


def int8_sensitivity(fp32_path: Path, samples: Samples, workdir: Path) -> list[dict[str, Any]]:
    """Each weight MatMul quantized alone (dynamic int8, as :func:`quantize_int8`), most
    damaging first: ``node``, ``module``, ``worst_drop`` and ``mean_drop`` of the cosine to the
    float32 session's embeddings over ``samples``. About 3 s per MatMul (36 of them)."""
    reference, _ = ort_sorted(ort_session(fp32_path), samples)
    rows = []
    for node, module in weight_matmuls(fp32_path).items():
        path = quantize_int8(fp32_path, workdir / "one-matmul.onnx", nodes_to_quantize=[node])
        cosine = (ort_sorted(ort_session(path), samples)[0] * reference).sum(1)  # unit vectors: (n,)
        drop = 1.0 - cosine
        rows.append({"node": node, "module": module, "worst_drop": drop.max().item(), "mean_drop": drop.mean().item()})
    return sorted(rows, key=lambda r: -r["worst_drop"])


# -----------------------------------------------------------------------------
# the benchmark: correctness first, then speed

Recipe = tuple[str, Callable[[], tuple[torch.Tensor, float]]]


def describe_machine() -> str:
    """One line: the CPU, the flags that decide bf16 and int8 speed, threads, versions."""
    import onnxruntime

    from autotune.env import cpu_info

    cpu = cpu_info()
    flags = ", ".join(cpu["isa"]) or "none of note"
    return (
        f"CPU: {cpu['model']}, {cpu['usable_cores']} usable cores, torch on {torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()} kernels; flags: {flags}. "
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}"
    )


def _recipes(model: torch.nn.Module, n: int, work: Path, sensitivity: bool, n_keep_fp32: int) -> list[Recipe]:
    """The recipes to compare, the baseline first, each ready to run (ONNX files exported and
    quantized here, untimed)."""
    from benchmarks.text.workload import PAD_TO, dataset

    # The same tokens both ways (truncated at 64), so any difference is the recipe's.
    padded, natural = dataset(n, padded=PAD_TO), dataset(n, max_length=PAD_TO)
    fp32_onnx = export_onnx(model, work / "fp32.onnx")
    session = {
        "fp32": ort_session(fp32_onnx),
        "int8": ort_session(quantize_int8(fp32_onnx, work / "int8.onnx")),
        "int8_channel": ort_session(quantize_int8(fp32_onnx, work / "int8-channel.onnx", per_channel=True)),
    }
    recipes: list[Recipe] = [
        (f"fp32 eager, padded to {PAD_TO} (baseline)", lambda: fp32_padded(model, padded)),
        ("fp32 eager, trimmed", lambda: fp32_trimmed(model, natural)),
        ("fp32 eager, trimmed + sorted", lambda: fp32_sorted(model, natural)),
    ]
    skip = bf16_skip_reason()
    if skip is None:
        recipes.append((f"bf16 autocast, padded to {PAD_TO}", lambda: bf16_padded(model, padded)))
        recipes.append(("bf16 autocast, trimmed + sorted", lambda: bf16_sorted(model, natural)))
    else:
        print(f"bf16 autocast recipes skipped: {skip}", flush=True)
    recipes.append(("ORT fp32, trimmed + sorted", lambda: ort_sorted(session["fp32"], natural)))
    recipes.append(("ORT int8, trimmed + sorted", lambda: ort_sorted(session["int8"], natural)))
    recipes.append(("ORT int8 per-channel, trimmed + sorted", lambda: ort_sorted(session["int8_channel"], natural)))
    if sensitivity:
        kept = _sensitivity_table(fp32_onnx, natural[:128], work)[:n_keep_fp32]
        path = quantize_int8(fp32_onnx, work / "int8-kept.onnx", nodes_to_exclude=kept)
        session["int8_kept"] = ort_session(path)
        label = f"ORT int8 but the {n_keep_fp32} most sensitive, trimmed + sorted"
        recipes.append((label, lambda: ort_sorted(session["int8_kept"], natural)))
    return recipes


def _sensitivity_table(fp32_onnx: Path, samples: Samples, work: Path) -> list[str]:
    """Print :func:`int8_sensitivity`'s ranking; return its nodes, most sensitive first."""
    from benchmarks.core import table

    ranking = int8_sensitivity(fp32_onnx, samples, work)
    rows = [[r["module"], r["node"], f"{r['worst_drop']:.4f}", f"{r['mean_drop']:.5f}"] for r in ranking]
    title = f"int8 sensitivity: one MatMul quantized at a time, {len(samples)} sentences"
    table(title, "module|node|worst cosine drop|mean cosine drop", rows)
    return [r["node"] for r in ranking]


def check(recipes: list[Recipe], texts: list[str]) -> dict[str, dict[str, Any]]:
    """Each recipe's cosine to the first's (the baseline's) embeddings, sentence by sentence:
    the worst, the mean and the worst sentence's index. Runs every recipe once: its warm-up."""
    from benchmarks.core import table

    outputs = {label: fn()[0] for label, fn in recipes}
    reference = next(iter(outputs.values()))
    checks = {}
    for label, emb in outputs.items():
        cosine = (emb * reference).sum(1)  # unit vectors: (n,)
        worst = int(cosine.argmin())
        checks[label] = {"worst_cosine": cosine[worst].item(), "mean_cosine": cosine.mean().item(), "worst": worst}
    rows = [
        [k, f"{c['worst_cosine']:.5f}", f"{c['mean_cosine']:.5f}", texts[c["worst"]][:60]] for k, c in checks.items()
    ]
    rows[0][3] = "(the reference)"
    table("Correctness: cosine to the baseline's embeddings", "recipe|worst|mean|worst sentence", rows)
    return checks


def time_rounds(recipes: list[Recipe], n: int, n_rounds: int) -> dict[str, Any]:
    """Seconds of each recipe's pass in ``n_rounds`` rounds, the order alternating so that a
    drift slower than a round cancels; ratios to the baseline are per round, then the median."""
    from benchmarks.core import OthersCPU, spread_of, table

    seconds: dict[str, list[float]] = {label: [] for label, _ in recipes}
    others = OthersCPU()
    for r in range(n_rounds):
        for label, fn in recipes if r % 2 == 0 else recipes[::-1]:
            seconds[label].append(fn()[1])
    others_cores = others()
    base = next(iter(seconds.values()))
    rows = []
    for label, times in seconds.items():
        ratios = [b / t for b, t in zip(base, times, strict=True)]
        rows.append([label, f"{n / statistics.median(times):,.0f}", spread_of(ratios)])
    title = f"Speed: {n} sentences, batch {BATCH_SIZE}, {n_rounds} rounds (others' cores {others_cores:.2f})"
    table(title, "recipe|sentences/s (median)|vs baseline", rows)
    return {"seconds": seconds, "others_cores": others_cores}


def median_ratio(seconds: dict[str, list[float]], base: str, label: str) -> float:
    """The median over rounds of ``label``'s speed over ``base``'s, from :func:`time_rounds`'s
    per-round seconds of each recipe."""
    times = seconds[label]
    return sorted(b / t for b, t in zip(seconds[base], times, strict=True))[len(times) // 2]


def run(n: int = 384, n_rounds: int = 3, *, sensitivity: bool = False, n_keep_fp32: int = 3) -> dict[str, Any]:
    """Check every recipe against the baseline's embeddings, then time them: both tables
    printed, the numbers returned. ``sensitivity`` adds the int8 ranking and a recipe that keeps
    its ``n_keep_fp32`` most sensitive MatMuls in float32."""
    import tempfile

    from benchmarks.text.workload import PAD_TO, dataset, minilm, sentences

    texts = sentences(n)  # first: a bad n fails before anything is loaded
    print(describe_machine(), flush=True)
    model = minilm()
    lengths = [len(s["input_ids"]) for s in dataset(n)]
    print(
        f"{n} sentences of {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / n:.1f}); "
        f"{sum(length > PAD_TO for length in lengths)} truncated to {PAD_TO}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        recipes = _recipes(model, n, Path(tmp), sensitivity, n_keep_fp32)
        checks = check(recipes, texts)
        return {"checks": checks, **time_rounds(recipes, n, n_rounds)}


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.text``: the recipes, checked then timed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.text", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=384, help="sentences (default 384)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, the order alternating (default 3)")
    parser.add_argument("--quick", action="store_true", help="64 sentences, 2 rounds: a smoke test")
    parser.add_argument(
        "--sensitivity", action="store_true", help="also int8 one MatMul at a time (about 2 minutes on 2 cores)"
    )
    args = parser.parse_args(argv)
    try:
        run(64 if args.quick else args.n, 2 if args.quick else args.rounds, sensitivity=args.sensitivity)
    except (ImportError, ValueError) as e:  # the extra or the weights missing, a bad --n
        parser.exit(2, f"{e}\n")
