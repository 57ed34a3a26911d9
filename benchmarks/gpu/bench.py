"""The GPU headline benchmark: a user's loop, an expert's recipe and autotune's winner, timed side
by side in one process on one CUDA GPU, with the model alone on a batch already on the GPU as
the ceiling. About 5 minutes on an H100.

    python -m benchmarks.gpu [--out DIR] [--budget-s 300] [--workloads resnet50-float,...] [--trials 12]
    python -m benchmarks.run --suite gpu [--out DIR]      # the same, at the default budget

Workloads (:mod:`benchmarks.gpu.workloads`), 1,024 samples each: ``resnet50-float`` (ResNet-50 on
224x224 float32 images in memory), ``resnet50-uint8`` (the same images stored as uint8, cast and
normalized by the model's first step on the GPU) and ``bert-text`` (a BERT-base-shaped encoder on
sentences of 16 to 128 tokens, padded to 128 by the user's collate). Rows of each:

- baseline: fp32 eager, batch 64, no loader workers: ``for batch in loader: model(batch.to(device))``;
- expert: bf16 autocast, channels-last, ``cudnn.benchmark``, batch 256, 8 pinned loader workers
  with non-blocking copies, ``torch.compile``;
- resident (images): what an expert writes for a dataset that fits the card: the images copied to
  the GPU once, each batch a slice there, bf16 autocast, channels-last, ``cudnn.benchmark``,
  ``torch.compile``, batch 256;
- autotune: ``autotune.optimize(model, dataset, space="gpu", device="cuda", repeated_passes=True,
  ...)`` within the budget (the rows read the same images every epoch), its winner re-timed here
  through ``autotune.apply`` and ``autotune.dataloader``;
- ceiling: the fastest of the rows' models alone, on one batch already on the GPU. Each row's
  own model alone (the baseline's too) is beside it: how much of its model a pipeline delivers.

Each figure is whole epochs, the device synchronized before the clock is read, for at least a
second a round (:mod:`benchmarks.gpu.timing`); the rows take turns over :data:`N_ROUNDS` rounds,
each round starting one row later (no row always follows the same one: the expert's workers leave
freed shared and pinned memory behind), and the median is shown. A row that fails is reported in its place and the others still run. Process-wide settings (cuDNN autotuning, TF32) are each row's own, stock for the
baseline. The budget is split evenly over the workloads, and autotune's search gets
:data:`SEARCH_SHARE` of each share (a minute at least); a workload that cannot fit in what is
left is left out, saying so. Nothing is asserted: the table is printed and written to
``OUT/gpu.md`` and ``OUT/gpu.json`` after each workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from benchmarks.core import Workload, workload, workloads
from benchmarks.gpu.timing import Flags, Row, model_alone, time_epochs, warm

N_SAMPLES = 1024
BASELINE_BATCH, EXPERT_BATCH, EXPERT_WORKERS = 64, 256, 8
N_ROUNDS = 3
SEARCH_SHARE = 0.5  # of a workload's share of the budget, for autotune's search (optimize's timeout)
MIN_SEARCH_S = 60.0  # optimize ends its search 20 s before its timeout: the baseline trial needs the rest
MIN_WORKLOAD_S = 60.0  # a workload is left out (saying why) when less is left, or 80% of what the last one took


def spec_of(w: Workload) -> tuple[dict[str, Any], Any]:
    """The rows' spec of a workload (its model factory, the user's collate, what a sample is, the
    guard's allowed drop) and its data set of :data:`N_SAMPLES`."""
    cfg = w.build(n=N_SAMPLES)
    collate = cfg.get("options", {}).get("collate_fn")
    spec = {
        "model": cfg["model"],
        "collate": collate,
        "unit": w.extras["unit"],
        "max_metric_drop": cfg["max_metric_drop"],
    }
    return spec, cfg["dataset"]


def baseline_row(spec: dict[str, Any], data: Any, device: Any, stock: Flags) -> Row:
    """The model as given, fp32 eager, batch 64 read in this process."""
    from torch.utils.data import DataLoader

    loader = DataLoader(data, batch_size=BASELINE_BATCH, collate_fn=spec["collate"])
    model = spec["model"]().to(device)
    return Row("baseline", model, loader, stock, BASELINE_BATCH, f"fp32 eager, batch {BASELINE_BATCH}, no workers")


def expert_row(spec: dict[str, Any], data: Any, device: Any, stock: Flags) -> Row:
    """bf16 autocast, channels-last, cuDNN autotuning, batch 256, 8 pinned workers with
    non-blocking copies, torch.compile (default mode)."""
    import torch
    from torch.utils.data import DataLoader

    workers = min(EXPERT_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else EXPERT_WORKERS)
    loader = DataLoader(data, batch_size=EXPERT_BATCH, num_workers=workers, pin_memory=True, persistent_workers=True,
                        collate_fn=spec["collate"])  # fmt: skip
    images = spec["collate"] is None
    model = spec["model"]().to(device)
    if images:
        model = model.to(memory_format=torch.channels_last)
    flags = dataclasses.replace(stock, cudnn_benchmark=True)
    what = (
        f"bf16 autocast{', channels-last' if images else ''}, cudnn.benchmark, batch {EXPERT_BATCH}, "
        f"{workers} pinned workers, non_blocking, torch.compile"
    )
    return Row("expert", torch.compile(model), loader, flags, EXPERT_BATCH, what, torch.bfloat16, images, True)


class DeviceSlices:
    """A dataset's tensors copied to the device once, yielded as consecutive batches sliced there:
    the hand-written resident loop, ``for i in range(0, n, b): x[i:i + b]``."""

    def __init__(self, tensors: tuple[Any, ...], batch_size: int, device: Any) -> None:
        self.tensors = [t.to(device) for t in tensors]
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.tensors[0]) // self.batch_size)

    def __iter__(self) -> Any:
        n, b = len(self.tensors[0]), self.batch_size
        return iter([[t[i : i + b] for t in self.tensors] for i in range(0, n, b)])


def resident_row(spec: dict[str, Any], data: Any, device: Any, stock: Flags, compiled: bool = True) -> Row:
    """The expert's device-resident recipe: the images on the device, batches sliced there, bf16,
    channels-last, ``cudnn.benchmark``, compiled, batch 256."""
    import torch

    model = spec["model"]().to(device).to(memory_format=torch.channels_last)
    flags = dataclasses.replace(stock, cudnn_benchmark=True)
    what = f"images on the device, sliced batches, bf16 autocast, channels-last, cudnn.benchmark, batch {EXPERT_BATCH}"
    model = torch.compile(model) if compiled else model
    loader = DeviceSlices(data.tensors, EXPERT_BATCH, device)
    return Row("resident", model, loader, flags, EXPERT_BATCH, what + (", torch.compile" if compiled else ""),
               torch.bfloat16, True, False)  # fmt: skip


def autotune_row(spec: dict[str, Any], data: Any, result: Any, device: Any, stock: Flags) -> Row:
    """The search's winner as a user rebuilds it: ``autotune.apply`` and ``autotune.dataloader``
    (with ``device=`` where it takes one), copies non-blocking when the batches are pinned."""
    import autotune

    config = result.best_config
    model = autotune.apply(spec["model"](), config, device=str(device), dataset=data, collate_fn=spec["collate"])
    flags = Flags.read()  # what apply turned on for this process (cuDNN autotuning, TF32): the row's own
    stock.set()
    extra = {"device": str(device)} if "device" in inspect.signature(autotune.dataloader).parameters else {}
    loader = autotune.dataloader(data, config, collate_fn=spec["collate"], **extra)
    changes = winner_changes(result)
    return Row(
        "autotune",
        model,
        loader,
        flags,
        config["batch_size"],
        changes,
        non_blocking=bool(getattr(loader, "pin_memory", False)),
    )


def winner_changes(result: Any) -> str:
    """The winner's knob values that differ from the baseline trial's, e.g. ``batch_size=512, amp_dtype=bfloat16``."""
    base = next((t.user_attrs["config"] for t in result.study.trials if t.user_attrs.get("baseline")), {})
    changed = [f"{k}={v}" for k, v in result.best_config.items() if k in base and base[k] != v]
    return ", ".join(changed) or "the baseline (nothing beat it)"


def search(name: str, spec: dict[str, Any], data: Any, out: Path, search_s: float, n_trials: int, device: Any) -> Any:
    """autotune's search on the workload, within ``search_s`` seconds (optimize's ``timeout``)."""
    import autotune

    shutil.rmtree(out / name, ignore_errors=True)  # an earlier run's study would refuse to start again
    return autotune.optimize(
        spec["model"],
        data,
        space="gpu",
        device=str(device),
        n_trials=n_trials,
        timeout=search_s,
        out_dir=out / name,
        baseline_batch_size=BASELINE_BATCH,
        collate_fn=spec["collate"],
        max_metric_drop=spec["max_metric_drop"],
        export=(),
        profile=False,
        # The rows read the same samples every epoch, as a training loop or repeated inference
        # over a fixed set does: the levers that pay there (the samples kept on the device) apply.
        repeated_passes=True,
    )


def _failure(exc: BaseException) -> str:
    """An exception as one line (its traceback goes to stderr, the benchmark's log)."""
    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def build_rows(
    name: str, spec: dict[str, Any], data: Any, out: Path, budget: tuple[float, int], device: Any, stock: Flags
) -> tuple[list[Row], Any, dict[str, str]]:
    """autotune's search (``budget``: its seconds and trials), then the baseline, expert and
    autotune rows; ``(rows, the search's result or None, {recipe: why it failed})``. Only the
    baseline's failure ends the workload: another row's is reported in its place."""
    failed: dict[str, str] = {}
    try:
        result = search(name, spec, data, out, *budget, device)
    except Exception as exc:
        result, failed["autotune"] = None, f"the search failed: {_failure(exc)}"
    rows = [baseline_row(spec, data, device, stock)]
    builders = {"expert": lambda: expert_row(spec, data, device, stock)}
    if spec["collate"] is None and hasattr(data, "tensors"):  # images in tensors: the resident recipe
        builders["resident"] = lambda: resident_row(spec, data, device, stock)
    if result is not None:
        builders["autotune"] = lambda: autotune_row(spec, data, result, device, stock)
    for recipe, build in builders.items():
        try:
            rows.append(build())
        except Exception as exc:
            failed[recipe] = _failure(exc)
    return rows, result, failed


def measure_rows(rows: list[Row], device: Any, stock: Flags, failed: dict[str, str]) -> tuple[list[Row], dict]:
    """Warm every row up, then time them in alternating rounds, then each model alone; a row
    that fails (a loader worker out of shared memory, say) is left out and named in ``failed``.
    Returns the rows measured and ``{recipe: samples/s of its model alone}``."""
    import torch

    with torch.inference_mode():
        for row in list(rows):
            try:
                warm(row, device, stock)
            except Exception as exc:
                if row.recipe == "baseline":
                    raise
                failed[row.recipe] = _failure(exc)
                rows.remove(row)
        for i in range(N_ROUNDS):
            for row in rotated(rows, i):
                row.rates.append(time_epochs(row, device, stock))
        alone = {row.recipe: model_alone(row, device, stock, N_SAMPLES) for row in rows}
    return rows, alone


def rotated(rows: list[Any], i: int) -> list[Any]:
    """Round ``i``'s order: each round starts one row later, so no row always follows the same one.

    Example:
        >>> [rotated(["a", "b", "c"], i) for i in range(3)]
        [['a', 'b', 'c'], ['b', 'c', 'a'], ['c', 'a', 'b']]
    """
    k = i % len(rows) if rows else 0
    return rows[k:] + rows[:k]


def run_workload(w: Workload, out: Path, search_s: float, n_trials: int, where: str = "cuda") -> dict[str, Any]:
    """The workload's four rows, measured on ``where``; its record for the table and the JSON."""
    import torch

    device, stock = torch.device(where), Flags.read()
    started = time.perf_counter()
    name, (spec, data) = w.name, spec_of(w)
    rows, result, failed = build_rows(name, spec, data, out, (search_s, n_trials), device, stock)
    searched = time.perf_counter() - started
    rows, alone = measure_rows(rows, device, stock, failed)
    base = statistics.median(rows[0].rates)
    table = [_row_record(r, base, alone.get(r.recipe)) for r in rows]
    table += [{"recipe": r, "error": why} for r, why in failed.items()]
    if alone:
        best = max(alone, key=alone.__getitem__)
        table.append({
            "recipe": "ceiling",
            "samples_per_s": alone[best],
            "x_baseline": alone[best] / base,
            "batch_size": next(r.batch_size for r in rows if r.recipe == best),
            "warmup_s": None,
            "what": f"the {best} model alone on one batch already on the device",
            "alone": alone,
        })  # fmt: skip
    return {
        "workload": name,
        "unit": spec["unit"],
        "rows": table,
        "claimed_speedup": None if result is None else result.speedup,
        "n_trials": 0 if result is None else sum(bool(t.user_attrs.get("ran")) for t in result.study.trials),
        "search_s": round(searched, 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _row_record(row: Row, base: float, alone: float | None = None) -> dict[str, Any]:
    rate = statistics.median(row.rates)
    return {"recipe": row.recipe, "samples_per_s": rate, "x_baseline": rate / base, "batch_size": row.batch_size,
            "of_alone": None if not alone else rate / alone,
            "warmup_s": round(row.warmup_s, 1), "what": row.what, "rounds": [round(r, 1) for r in row.rates]}  # fmt: skip


def _release() -> None:
    """Give back what a workload held: loader workers, compiled graphs, cached GPU memory."""
    import torch

    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def table_text(docs: list[dict[str, Any]]) -> str:
    """One Markdown table over the workloads: each recipe's rate, its ratio to the baseline, its
    batch and warm-up, and what it runs; then autotune's own claim beside the re-timed ratio."""
    head = "| workload | recipe | samples/s | x baseline | of its model alone | batch | warm-up s | what it runs |"
    lines = [head, "|" + "---|" * 8]
    notes = []
    for doc in docs:
        if "error" in doc:
            notes.append(f"- {doc['workload']}: not measured: {doc['error']}")
            continue
        unit = doc["unit"].split("/")[0]
        for r in doc["rows"]:
            if "error" in r:
                cells = [doc["workload"], r["recipe"], "failed", "", "", "", "", r["error"]]
            else:
                warmup = "" if r["warmup_s"] is None else f"{r['warmup_s']:.1f}"
                share = "" if r.get("of_alone") is None else f"{r['of_alone']:.0%}"
                cells = [doc["workload"], r["recipe"], f"{r['samples_per_s']:,.0f} {unit}/s",
                         f"{r['x_baseline']:.2f}x", share, r["batch_size"], warmup, r["what"]]  # fmt: skip
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
        retimed = next(
            (f"{r['x_baseline']:.2f}x" for r in doc["rows"] if r["recipe"] == "autotune" and "error" not in r), "-"
        )
        claimed = "-" if doc["claimed_speedup"] is None else f"{doc['claimed_speedup']:.2f}x"
        notes.append(
            f"- {doc['workload']}: autotune claimed {claimed} over its own baseline (batch {BASELINE_BATCH}), "
            f"re-timed here {retimed}; {doc['n_trials']} trials in {doc['search_s']:.0f} s of search, "
            f"{doc['wall_s']:.0f} s in all"
        )
    return "\n".join(["### GPU headline: samples/s by recipe", "", *lines, "", *notes]) + "\n"


def header() -> str:
    import torch

    props = torch.cuda.get_device_properties(0)
    return (
        f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor}), "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}"
    )


def write(out: Path, head: str, docs: list[dict[str, Any]], budget_s: float, wall_s: float) -> str:
    """Write ``gpu.json`` and ``gpu.md`` under ``out``; return the Markdown."""
    text = "\n".join([head, "", table_text(docs), f"wall time: {wall_s:.0f} s of a {budget_s:.0f} s budget"]) + "\n"
    (out / "gpu.md").write_text(text)
    doc = {"machine": head, "budget_s": budget_s, "wall_s": wall_s, "workloads": docs}
    (out / "gpu.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    names = [w.name for w in workloads(benchmark="gpu")]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="directory of gpu.md, gpu.json and the searches' output")
    parser.add_argument("--budget-s", type=float, default=300.0, help="seconds for every workload (default 300)")
    parser.add_argument("--workloads", default=",".join(names), help=f"comma-separated, of {', '.join(names)}")
    parser.add_argument("--trials", type=int, help="autotune's trials per workload at most (default 12)")
    args = parser.parse_args(argv)
    chosen = args.workloads.split(",")
    unknown = [n for n in chosen if n not in names]
    if unknown:
        parser.error(f"No workload named {unknown[0]!r}. Known: {', '.join(names)}.")
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"The GPU benchmark needs a CUDA GPU, and torch {torch.__version__} sees none here.")
    out = args.out or Path(tempfile.gettempdir()) / "autotune-bench-gpu"
    out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message="Some regimes for parameter", category=UserWarning)
    head = header()
    print(head, flush=True)
    started = time.perf_counter()
    deadline = started + args.budget_s
    docs: list[dict[str, Any]] = []
    last_s = 0.0  # what the workload before took: the best guess of what the next one needs
    for i, name in enumerate(chosen):
        left = deadline - time.perf_counter()
        share = left / (len(chosen) - i)
        if left < max(MIN_WORKLOAD_S, 0.8 * last_s):
            why = f"left out: {left:.0f} s of the budget were left, and the workload before took {last_s:.0f} s"
            docs.append({"workload": name, "error": why})
            continue
        search_s = max(MIN_SEARCH_S, SEARCH_SHARE * share)
        print(f"{name}: {share:.0f} s, {search_s:.0f} s of them for autotune's search", flush=True)
        begun = time.perf_counter()
        try:
            w = workload(name)
            docs.append(run_workload(w, out, search_s, args.trials or w.trials()))
        except Exception as exc:  # one workload's failure is reported; the others still run
            docs.append({"workload": name, "error": _failure(exc)})
        _release()
        last_s = time.perf_counter() - begun
        write(out, head, docs, args.budget_s, time.perf_counter() - started)
    print("\n" + write(out, head, docs, args.budget_s, time.perf_counter() - started), flush=True)
    print(f"wrote {out / 'gpu.md'} and {out / 'gpu.json'}")
