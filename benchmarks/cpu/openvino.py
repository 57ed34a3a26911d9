"""CNNs on a CPU, OpenVINO beside PyTorch: the plain loop, the best PyTorch hand recipe, OpenVINO
by hand (float32, the bf16 hint where the CPU has bf16 units, NNCF int8 with its defaults) and
autotune's winner, side by side in one process.

Workloads:

- ``digits``: the CNN of examples/digits.py on scikit-learn's handwritten digits (real data,
  real accuracy), the 359 tuning samples;
- ``resnet``: a ResNet-50-shaped CNN (bottleneck blocks, one per stage, 64 channels wide),
  random weights seeded, on 256 in-memory float images of 64x64: its figure beside each row is
  the worst cosine of the logits to the plain loop's.

Per workload:

1. ``autotune.optimize(model, dataset, n_trials=16)`` with the default space, in a fresh process
   (``--search-only``), with the digits' accuracy as metric.
2. This process builds every row once, checks it (accuracy, or the worst cosine), then times the
   rows in rounds of rotating order over the whole dataset (:func:`benchmarks.core.rotating_rounds`),
   each ratio the geometric mean over rounds of its rate over the plain loop's:

   - the plain loop: the model as given, fp32 eager, batches of 32 from a ``DataLoader``;
   - PyTorch by hand: channels-last, batches of 64, and bf16 autocast where the CPU has bf16
     units (the better of fp32 and bf16 that keeps the figure is the PyTorch expert);
   - OpenVINO by hand: ``openvino.convert_model`` with a dynamic batch, compiled once (latency
     hint, torch's threads), batches of 32: fp32, the bf16 hint, and ``nncf.quantize`` with its
     defaults on 128 held-out samples;
   - autotune's winner through ``autotune.apply`` + ``autotune.dataloader``, and through
     ``autotune.load(out).predict``.

Usage (with the openvino extra)::

    python -m benchmarks.cpu.openvino                       # both workloads: search, then compare
    python -m benchmarks.cpu.openvino --workloads digits    # one
    python -m benchmarks.cpu.openvino --load OUT            # compare finished searches again
    python -m benchmarks.cpu.openvino --smoke               # 2 trials, 1 round: it all runs

Nothing here asserts a speed: time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import core
from benchmarks.core import machine, ratios_to, rotating_rounds, table

HOLD = 0.01  # the guard every row is held to: accuracy within a point, or worst cosine 0.99
# The run's own settings: every workload searched with the same trials (the default space), and
# the comparison's rounds.
RUNS = {
    "full": {"trials": 16, "rounds": 7, "seconds": 1.0},
    "smoke": {"trials": 2, "rounds": 1, "seconds": 0.1},
}


def workload(name: str) -> dict[str, Any]:
    """``model``, ``dataset`` (tuples of image and label), ``held_out`` (128 samples never tuned
    on, for NNCF's calibration) and ``metric`` (``None``: fidelity to the plain loop's logits)."""
    cfg = core.workload(name).build()
    return {"model": cfg["model"], "dataset": cfg["dataset"], "held_out": cfg["train_dataset"][:128],
            "metric": cfg.get("metric")}  # fmt: skip


def search(name: str, out: Path, n_trials: int) -> None:
    """Tune ``name`` in this process (the default space), into ``out``."""
    import autotune

    w = workload(name)
    options = {"metric": w["metric"]} if w["metric"] is not None else {}
    result = autotune.optimize(w["model"], w["dataset"], n_trials=n_trials, out_dir=out, **options)
    print(f"{name}: {result.speedup:.2f}x claimed ({result.verdict}); winner {result.best_config}", flush=True)


def _loop(net: Callable[[torch.Tensor], Any], samples: list, batch_size: int, **kw: Any) -> Callable[[], torch.Tensor]:
    """A pass over ``samples`` in batches through ``net``: the logits, in order."""
    loader = torch.utils.data.DataLoader(samples, batch_size=batch_size)
    channels_last, bf16 = kw.get("channels_last", False), kw.get("bf16", False)

    def run() -> torch.Tensor:
        out = []
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for x, _ in loader:
                if channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                out.append(torch.as_tensor(net(x)).float())
        return torch.cat(out)

    return run


def _openvino(model: torch.nn.Module, samples: list, held_out: list, precision: str) -> Callable[[], torch.Tensor]:
    """OpenVINO by hand: converted with a dynamic batch, compiled once, batches of 32."""
    import nncf
    import openvino as ov

    example = torch.stack([s[0] for s in samples[:2]])
    converted = ov.convert_model(model, example_input=example)
    converted.reshape([-1, *example.shape[1:]])
    if precision == "int8":
        calibration = [torch.stack([s[0] for s in held_out[i : i + 32]]).numpy() for i in range(0, len(held_out), 32)]
        converted = nncf.quantize(converted, nncf.Dataset(calibration), subset_size=len(held_out))
    config = {"INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32", "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_NUM_THREADS": torch.get_num_threads()}  # fmt: skip
    request = ov.Core().compile_model(converted, "CPU", config).create_infer_request()

    def net(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(request.infer([x.numpy()], share_inputs=True).to_tuple()[0]).copy())

    return _loop(net, samples, 32)


def _tuned(out: Path, w: dict[str, Any]) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """autotune's winner: ``apply`` + ``dataloader``, and ``load(out).predict``."""
    import autotune
    from autotune.samples import call_model

    net = autotune.apply(w["model"], out, dataset=w["dataset"], device="cpu")
    loader = autotune.dataloader(w["dataset"], out)
    threads = torch.get_num_threads()  # apply set the winner's
    served = autotune.load(out)

    def applied() -> torch.Tensor:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            return torch.cat([torch.as_tensor(call_model(net, batch)).float() for batch in loader])

    def loaded() -> torch.Tensor:
        rows = served.predict([s[0] for s in w["dataset"]])
        return torch.stack([torch.as_tensor(np.asarray(r)) for r in rows]).float()

    return applied, loaded


def rows(w: dict[str, Any], out: Path) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """Every row of the comparison of workload ``w``, built once."""
    from benchmarks.text.recipes import bf16_skip_reason

    model, samples = w["model"].eval(), w["dataset"]
    stock = torch.get_num_threads()
    last = _copy_channels_last(model)
    found = [
        ("fp32 eager, batch 32 (baseline)", _loop(model, samples, 32)),
        ("PyTorch fp32, channels-last, batch 64", _loop(last, samples, 64, channels_last=True)),
    ]
    if bf16_skip_reason() is None:
        found.append(
            ("PyTorch bf16 autocast, channels-last, batch 64", _loop(last, samples, 64, channels_last=True, bf16=True))
        )
        found.append(("OpenVINO bf16 hint, batch 32", _openvino(model, samples, w["held_out"], "bf16")))
    found.insert(2, ("OpenVINO fp32, batch 32", _openvino(model, samples, w["held_out"], "fp32")))
    found.append(("OpenVINO int8 (NNCF defaults), batch 32", _openvino(model, samples, w["held_out"], "int8")))
    applied, loaded = _tuned(out, w)
    torch.set_num_threads(stock)
    found += [("autotune: apply + dataloader", applied), ("autotune.load(out).predict", loaded)]
    return found


def _copy_channels_last(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).to(memory_format=torch.channels_last)


def quality(name: str, w: dict[str, Any], outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each row's accuracy (digits) or worst cosine of its logits to the baseline's (resnet)."""
    base = next(iter(outputs.values()))
    if name == "digits":
        labels = torch.stack([s[1] for s in w["dataset"]])
        return {k: (v.argmax(1) == labels).float().mean().item() for k, v in outputs.items()}
    return {k: torch.nn.functional.cosine_similarity(v, base).min().item() for k, v in outputs.items()}


def compare(name: str, out: Path, rounds: int, seconds: float) -> dict[str, Any]:
    """Check, then time, every row of ``name``; print the table and the issue's two ratios."""
    w = workload(name)  # built once: the digits CNN is trained when its cfg.py is read
    built = rows(w, out)
    n = len(w["dataset"])
    figures = quality(name, w, {label: run() for label, run in built})
    rates = rotating_rounds(dict(built), n, rounds, seconds)
    ratios = ratios_to(rates, built[0][0])
    floor = figures[built[0][0]] - HOLD if name == "digits" else 1.0 - HOLD
    kept = {k for k, v in figures.items() if v >= floor}
    torch_best = max((k for k in kept if k.startswith("PyTorch")), key=ratios.get, default=None)
    ov_best = max((k for k in kept if k.startswith("OpenVINO")), key=ratios.get, default=None)
    what = "accuracy" if name == "digits" else "worst cosine"
    cells = [[k, f"{np.median(rates[k]):,.0f}", f"{ratios[k]:.2f}x", f"{figures[k]:.4f}"] for k, _ in built]
    table(f"{name}: {n} samples, {rounds} rounds", f"recipe | samples/s (median) | vs baseline | {what}", cells)
    for label in ("autotune: apply + dataloader", "autotune.load(out).predict"):
        line = f"{name}, {label}: {ratios[label]:.2f}x the baseline"
        for best in (torch_best, ov_best):
            if best is not None:
                line += f", {ratios[label] / ratios[best]:.2f}x {best}"
        print(line, flush=True)
    return {
        "ratios": ratios,
        "figures": figures,
        "rates": rates,
        "torch_expert": torch_best,
        "openvino_expert": ov_best,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu.openvino", description=__doc__.split("\n\n")[0])
    known = [w.name for w in core.workloads(benchmark="cpu.openvino")]
    parser.add_argument("--workloads", default=",".join(known), help="comma-separated: digits, resnet")
    parser.add_argument("--out", type=Path, default=Path("benchmark-out/cpu-openvino"), help="the runs' directory")
    parser.add_argument("--load", type=Path, help="compare the runs in this directory; no search")
    parser.add_argument("--search-only", action="store_true", help="search, then stop")
    parser.add_argument("--smoke", action="store_true", help="tiny budget: checks that everything runs")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        parser.error(f"unknown workload {unknown[0]!r}: choose among {', '.join(known)}")
    budget = RUNS["smoke" if args.smoke else "full"]
    base = args.load or args.out
    if args.search_only:
        for name in names:
            search(name, base / name, budget["trials"])
        return 0
    if args.load is None:  # each search in a fresh process; the comparison in this one
        command = [sys.executable, "-m", "benchmarks.cpu.openvino", "--search-only", "--out", str(base)]
        subprocess.run([*command, "--workloads", ",".join(names), *(["--smoke"] if args.smoke else [])], check=True)
    print(json.dumps(machine()), flush=True)
    results = {name: compare(name, base / name, budget["rounds"], budget["seconds"]) for name in names}
    (base / "cpu-openvino.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
