"""Real text, OpenVINO beside PyTorch: the hand recipes a Sentence Transformers user would write
with OpenVINO, the best PyTorch hand recipe, and autotune's winner, side by side in one process.

The workload of :mod:`benchmarks.text.workload` (all-MiniLM-L6-v2, real sentences), as
:mod:`benchmarks.text.tune` has it: a dataset padded to 64 tokens, batched at 32, fp32 eager.
Rows, each checked (worst cosine to the baseline's embeddings) and then timed in alternating
rounds (:func:`benchmarks.text.recipes.time_rounds`):

- the plain fp32 loop (the baseline) and the PyTorch hand recipes (fp32, and bf16 autocast where
  the CPU has bf16 units, on trimmed, length-sorted batches): the best one that keeps the
  embeddings is the PyTorch expert;
- OpenVINO by hand, on trimmed, length-sorted batches: the model converted by
  ``openvino.convert_model`` with dynamic batch and length, in fp32, with the bf16 hint where the
  CPU has the units, and in int8 by ``nncf.quantize`` with its defaults (transformer scheme,
  calibrated on 96 held-out sentences);
- autotune's winner, re-timed through ``autotune.apply`` + the run's batching (what
  ``autotune.dataloader`` gives) and through ``autotune.load(out)`` on the same batches.

Usage (with the text and openvino extras and the weights, see docs/text-workload.md)::

    python -m benchmarks.text.openvino                        # search (16 trials, default space), then compare
    python -m benchmarks.text.openvino --load OUT             # compare a finished search again
    python -m benchmarks.text.openvino --search-only --out OUT && python -m benchmarks.text.openvino --load OUT
    python -m benchmarks.text.openvino --smoke                # 2 trials, 64 sentences, 1 round: it all runs

Nothing here asserts a speed: time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.text.recipes import BATCH_SIZE, encode, median_ratio

MAX_DROP = 0.02  # the guard the comparison holds every row to, as tune.py does: cosine 0.98
# The run's own settings: sentences, the search's trials and time, rounds of the comparison.
RUNS = {
    "full": {"n": 384, "trials": 16, "timeout": 1500.0, "rounds": 7},
    "smoke": {"n": 64, "trials": 2, "timeout": 300.0, "rounds": 1},
}


def ov_model(model: torch.nn.Module, calibration: list[dict[str, torch.Tensor]] | None = None) -> Any:
    """MiniLM as an ``openvino.Model`` with dynamic batch and length (``input_ids``,
    ``attention_mask`` -> embeddings); with ``calibration`` samples, NNCF's int8 of it with its
    defaults (the transformer scheme), as a Sentence Transformers user's static int8 export."""
    import nncf
    import openvino as ov

    from benchmarks.text.workload import pad_collate

    example = pad_collate(calibration[:2] if calibration else _two())
    args = (example["input_ids"], example["attention_mask"])
    converted = ov.convert_model(model, example_input=args)
    for port, name in zip(converted.inputs, ("input_ids", "attention_mask"), strict=True):
        port.get_tensor().set_names({name})
    converted.reshape({name: ov.PartialShape([-1, -1]) for name in ("input_ids", "attention_mask")})
    if not calibration:
        return converted
    batches = [pad_collate(calibration[i : i + BATCH_SIZE]) for i in range(0, len(calibration), BATCH_SIZE)]
    feeds = [{k: v.numpy() for k, v in b.items()} for b in batches]
    return nncf.quantize(converted, nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(feeds))


def _two() -> list[dict[str, torch.Tensor]]:
    ids = torch.tensor([101, 7592, 102])
    return [{"input_ids": ids, "attention_mask": torch.ones(3, dtype=torch.int64)}] * 2


def ov_sorted(model: Any, precision: str = "f32") -> Any:
    """A recipe: ``samples`` through an OpenVINO model compiled once for the CPU (latency hint,
    torch's thread count), on trimmed, length-sorted batches (:func:`benchmarks.text.recipes.encode`'s
    loop). Compiled here, not per pass: a user compiles once and serves, and a fresh compiled
    model pays each new batch shape's first run again."""
    import openvino as ov

    config = {
        "INFERENCE_PRECISION_HINT": precision,
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_NUM_THREADS": torch.get_num_threads(),
    }
    request = ov.Core().compile_model(model, "CPU", config).create_infer_request()

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = request.infer({k: v.numpy() for k, v in batch.items()}, share_inputs=True)
        return torch.from_numpy(np.asarray(out.to_tuple()[0]).copy())

    return lambda samples: encode(forward, samples, trim=True, sort=True)


def hand_recipes(model: torch.nn.Module, n: int) -> list[tuple[str, Any]]:
    """The baseline, the PyTorch hand recipes and the OpenVINO ones, ready to run."""
    from benchmarks.text.recipes import bf16_skip_reason, bf16_sorted, fp32_padded, fp32_sorted
    from benchmarks.text.workload import PAD_TO, dataset

    padded, natural = dataset(n, padded=PAD_TO), dataset(n, max_length=PAD_TO)
    held_out = dataset(n + 96, max_length=PAD_TO)[n:]  # NNCF calibrates on sentences never checked
    fp32, int8 = ov_model(model), ov_model(model, held_out)
    recipes: list[tuple[str, Any]] = [
        (f"fp32 eager, padded to {PAD_TO} (baseline)", lambda: fp32_padded(model, padded)),
        ("PyTorch fp32, trimmed + sorted", lambda: fp32_sorted(model, natural)),
    ]
    bf16 = bf16_skip_reason() is None
    if bf16:
        recipes.append(("PyTorch bf16 autocast, trimmed + sorted", lambda: bf16_sorted(model, natural)))
    ov_fp32 = ov_sorted(fp32)
    recipes.append(("OpenVINO fp32, trimmed + sorted", lambda: ov_fp32(natural)))
    if bf16:
        ov_bf16 = ov_sorted(fp32, "bf16")
        recipes.append(("OpenVINO bf16 hint, trimmed + sorted", lambda: ov_bf16(natural)))
    ov_int8 = ov_sorted(int8)
    recipes.append(("OpenVINO int8 (NNCF defaults), trimmed + sorted", lambda: ov_int8(natural)))
    return recipes


def loaded_recipe(out: Path, n: int) -> tuple[str, Any]:
    """The run served by ``autotune.load(out)`` (the fastest of its files here, or its OpenVINO
    IR), fed the run's own batching of the user's samples through ``Predictor.predict``."""
    import autotune
    from benchmarks.text.tune import user_data

    samples, collate = user_data(n, False)
    served = autotune.load(out)

    def run() -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        rows = served.predict(samples, collate_fn=collate)
        emb = torch.stack([torch.as_tensor(np.asarray(r)) for r in rows]).float()
        return emb, time.perf_counter() - started

    return f"autotune.load(out): {served.format}", run


def compare(out: Path, n: int, n_rounds: int) -> dict[str, Any]:
    """Check, then time, every row; print both tables and the ratios the issue asks for."""
    from benchmarks.text.recipes import check, describe_machine, time_rounds
    from benchmarks.text.tune import tuned_recipe, user_data
    from benchmarks.text.workload import minilm, sentences

    texts = sentences(n)
    print(describe_machine(), flush=True)
    model = minilm()
    recipes = hand_recipes(model, n)
    recipes.append(tuned_recipe(out, *user_data(n, False)))
    recipes.append(loaded_recipe(out, n))
    checks = check(recipes, texts)
    timing = time_rounds(recipes, n, n_rounds)

    def ratio(label: str) -> float:
        return median_ratio(timing["seconds"], recipes[0][0], label)

    held = {label for label, c in checks.items() if c["worst_cosine"] >= 1 - MAX_DROP}
    torch_best = max((lbl for lbl, _ in recipes if lbl.startswith("PyTorch") and lbl in held), key=ratio)
    ov_rows = [lbl for lbl, _ in recipes if lbl.startswith("OpenVINO") and lbl in held]
    ov_best = max(ov_rows, key=ratio) if ov_rows else None
    summary = {
        "torch_expert": torch_best,
        "openvino_expert": ov_best,
        "ratios": {lbl: ratio(lbl) for lbl, _ in recipes},
    }
    for label, _ in recipes[-2:]:
        line = f"{label}: {ratio(label):.2f}x the baseline, {ratio(label) / ratio(torch_best):.2f}x {torch_best}"
        if ov_best is not None:
            line += f", {ratio(label) / ratio(ov_best):.2f}x {ov_best}"
        print(f"{line} (worst cosine {checks[label]['worst_cosine']:.4f})", flush=True)
    return {"checks": checks, **timing, **summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.text.openvino", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny budget: checks that everything runs")
    parser.add_argument("--space", default="default", help="preset to search (default: the default space)")
    parser.add_argument("--trials", type=int, help="trials of the search (default 16)")
    parser.add_argument("--out", type=Path, default=Path("benchmark-out/text-openvino"), help="the run's directory")
    parser.add_argument("--load", type=Path, help="compare the run in this directory; no search")
    parser.add_argument("--search-only", action="store_true", help="search, then stop (compare with --load later)")
    args = parser.parse_args(argv)
    budget = RUNS["smoke" if args.smoke else "full"]
    out = args.load or args.out
    if args.load is None:
        from benchmarks.text.tune import search

        search(out, budget["n"], args.trials or budget["trials"], budget["timeout"], args.space)
        if args.search_only:
            return 0
    result = compare(out, budget["n"], budget["rounds"])
    (out / "text-openvino.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
