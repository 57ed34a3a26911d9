"""autotune's performance claims, measured side by side in one run.

    python -m benchmarks.run --suite cpu           # about 8 minutes on 2 CPU cores (at most 15)
    python -m benchmarks.run --suite cpu --smoke   # CI: tiny budgets, under a minute
    python -m benchmarks.run --suite gpu           # one CUDA GPU, about 5 minutes (benchmarks/gpu/bench.py)
    python -m benchmarks.run --suite gpu-compare   # one CUDA GPU, aiming at 10 minutes

The cpu suite prints three parts, each as Markdown tables (also written to OUT/cpu.md, with all
numbers in OUT/cpu.json):

1. tuned vs baseline vs expert: the digits CNN, a 6-layer transformer encoder and an LSTM, each
   tuned with a fixed budget and compared with a hand-written recipe (benchmarks/compare.py);
2. search efficiency: a 48-configuration space measured whole, then the search replayed from
   those measurements for many seeds (benchmarks/search.py);
3. measurement quality: the spread of repeated measurements, and per-trial overhead
   (benchmarks/core.py).

The gpu suite is the GPU headline benchmark (benchmarks/gpu/bench.py): a user's loop, an expert's
recipe and autotune's winner on ResNet-50 (float and uint8 images) and a BERT-base-shaped encoder,
side by side in one process. The gpu-compare suite runs part 1 on a ResNet-50-shaped CNN and a
ViT-B/16-shaped encoder (benchmarks/gpu/models.py), fed from float tensors in memory and from uint8
images converted on the CPU. Nothing here asserts a speed: it prints, and targets read PASS/MISS
or met/not met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import compare, core, search, training

QUICK_MEASURE = {"n_windows": 2, "window_s": 0.1, "warmup_batches": 1, "n_remeasure": 0}
# Each suite's settings for the run; each workload brings its own trials and timing (its
# ``Workload`` in benchmarks/core.py), unless the suite sets them (the smoke run, --trials).
SUITES: dict[str, dict[str, Any]] = {
    "cpu": {
        "space": "cpu",
        "n_rounds": 3,
        "search_space": search.SPACE,
        "search_measure": search.MEASURE,
        "n_seeds": 20,
        "n_repeats": 10,
        "quality_measure": None,  # optimize's default timing (5 windows of >= 0.4 s)
    },
    "cpu-smoke": {
        "workloads": ("digits",),
        "space": "quick",
        "n_trials": 2,
        "n_rounds": 1,
        "measure": QUICK_MEASURE,
        "search_space": {"base": None, "batch_size": [16, 32, 64, 128]},
        "search_measure": QUICK_MEASURE,
        "n_seeds": 3,
        "n_repeats": 3,
        "quality_measure": QUICK_MEASURE,
        "train_workloads": ("digits",),
        "n_train_trials": 2,
    },
    "gpu-compare": {"space": "gpu", "n_rounds": 3},  # training-step tuning on the workloads that train
}
# The names a suite has always taken and printed, for workloads registered under another.
ALIASES = {"resnet50-uint8": "resnet50-uint8-cpu"}


def suite_workloads(suite: str, mode: str | None = None) -> list[str]:
    """The workloads ``suite`` runs when not told which (those that run in ``mode``), by the names it takes."""
    shown = {registered: name for name, registered in ALIASES.items()}
    return [shown.get(w.name, w.name) for w in core.workloads(benchmark=f"run.{suite}", mode=mode)]


def settings(budget: dict[str, Any], name: str, mode: str = "inference") -> dict[str, Any]:
    """``n_trials`` and ``measure`` of workload ``name`` in ``mode``: the budget's where it sets
    them, else the workload's own."""
    w = core.workload(ALIASES.get(name, name))
    n_trials = budget.get("n_trials" if mode == "inference" else "n_train_trials") or w.trials(mode)
    return {"n_trials": n_trials, "measure": budget["measure"] if "measure" in budget else w.measure}


def build(name: str) -> dict[str, Any]:
    """The cfg dict of workload ``name`` (a suite's name for it)."""
    return core.workload(ALIASES.get(name, name)).build()


def training_part(cfgs: dict[str, dict], out: Path, budget: dict[str, Any], unit: str) -> tuple[list[dict], str]:
    """Training-step throughput (``mode="train"``): baseline vs tuned vs the expert's training
    recipe for each workload (benchmarks/training.py)."""
    rows = []
    for name, cfg in cfgs.items():
        shutil.rmtree(out / f"train-{name}", ignore_errors=True)
        own = settings(budget, name, "train")
        rows.append(
            training.compare_training(name, cfg, out, space=budget["space"], n_rounds=budget["n_rounds"], **own)
        )
    return rows, training.print_training(rows, unit)


# -----------------------------------------------------------------------------


def cpu_suite(budget: dict[str, Any], names: list[str], out: Path, parts: str) -> tuple[dict[str, Any], list[str]]:
    cfgs = {name: build(name) for name in names} if "1" in parts or "3" in parts else {}
    doc: dict[str, Any] = {}
    tables = []
    if "1" in parts:
        rows = []
        for name, cfg in cfgs.items():
            shutil.rmtree(out / name, ignore_errors=True)  # an earlier run's study would refuse to restart
            own = settings(budget, name)
            rows.append(compare.compare(name, cfg, out, space=budget["space"], n_rounds=budget["n_rounds"], **own))
        tables.append(compare.print_compare(rows, "Part 1: tuned vs baseline vs expert, samples/s"))
        doc["compare"] = rows
    if "2" in parts:
        tiny = build("quickstart")
        space, measure, n_seeds = budget["search_space"], budget["search_measure"], budget["n_seeds"]
        doc["search"], text = search.efficiency("quickstart", tiny, out, space=space, measure=measure, n_seeds=n_seeds)
        tables.append(text)
    if "3" in parts:
        # One configuration measured again and again: the baseline of the first workload.
        first = next(iter(cfgs))
        runs = core.repeat_baseline(cfgs[first], first, budget["quality_measure"], budget["n_repeats"], out)
        doc["spread"], text_spread = core.spread(runs)
        studies = {r["workload"]: r.pop("trial_overheads") for r in doc.get("compare", [])}
        doc["overhead"], text_overhead = core.overhead(runs, studies)
        tables += [text_spread, text_overhead]
    if "4" in parts:
        train_names = budget.get("train_workloads") or suite_workloads("cpu", "train")
        train = {name: cfgs.get(name) or build(name) for name in train_names}
        doc["training"], text = training_part(train, out, budget, "samples/s")
        tables.append(text)
    return doc, tables


def gpu_suite(budget: dict[str, Any], names: list[str], out: Path, parts: str) -> tuple[dict[str, Any], list[str]]:
    rows = []
    for name in names:
        shutil.rmtree(out / name, ignore_errors=True)
        own = settings(budget, name)
        rows.append(compare.compare(name, build(name), out, space=budget["space"], n_rounds=budget["n_rounds"], **own))
    tables = [compare.print_compare(rows, "Tuned vs baseline vs expert, images/s")]
    doc: dict[str, Any] = {"compare": rows}
    train = {n: build(n) for n in names if "train" in core.workload(ALIASES.get(n, n)).modes}
    doc["training"], text = training_part(train, out, budget, "images/s")
    tables.append(text)
    return doc, tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=("cpu", "gpu", "gpu-compare"), required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny budgets: checks that everything runs (cpu only)")
    parser.add_argument("--out", type=Path, help="directory for the JSON, the tables and the caches")
    parser.add_argument("--workloads", help="comma-separated subset of the suite's workloads")
    parser.add_argument("--trials", type=int, help="tuning trials per workload (default: the suite's)")
    parser.add_argument("--parts", default="1234", help="cpu suite: which of parts 1-4 to run (default 1234)")
    args = parser.parse_args(argv)
    if args.smoke and args.suite != "cpu":
        parser.error("--smoke is for the cpu suite")
    if not args.parts or set(args.parts) - set("1234"):
        parser.error(f"--parts takes digits among 1, 2, 3 and 4 (e.g. 13), but got {args.parts!r}")
    if args.suite.startswith("gpu"):
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"--suite {args.suite} needs a CUDA device, and torch {torch.__version__} sees none here.")
    if args.suite == "gpu":  # the headline benchmark has its own runner and budget
        from benchmarks.gpu.bench import main as gpu_benchmark

        passed = {"--out": args.out, "--workloads": args.workloads, "--trials": args.trials}
        return gpu_benchmark([x for k, v in passed.items() if v is not None for x in (k, str(v))])
    key = args.suite + ("-smoke" if args.smoke else "")
    budget = dict(SUITES[key])
    if args.trials is not None:
        if args.trials < 1:
            parser.error(f"--trials must be at least 1, but got {args.trials}")
        budget["n_trials"] = args.trials
    known = suite_workloads(args.suite)
    names = args.workloads.split(",") if args.workloads else list(budget.get("workloads") or known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"No workload named {unknown[0]!r}. Known: {', '.join(known)}.")
    # A stable default: the search cache of part 2 is found again by the next run.
    out = args.out or Path(tempfile.gettempdir()) / f"autotune-bench-{key}"
    out.mkdir(parents=True, exist_ok=True)

    # Optuna warns when the parameter importance of report.html rests on few trials: a small budget.
    warnings.filterwarnings("ignore", message="Some regimes for parameter", category=UserWarning)
    started = time.perf_counter()
    info = core.machine()
    v = info["versions"]
    header = (
        f"autotune benchmarks, suite {key}, {info['date']}\n"
        f"{info['device']}: {info['gpu'] or info['cpu']}, {info['cpu_count']} cores, {info['cpu_capability']}, "
        f"{info['mem_gib']} GiB; python {v['python']}, torch {v['torch']}, optuna {v['optuna']}\n"
        f"load average (1 min): {os.getloadavg()[0]:.2f}; 'others' cores' = CPU used by other processes"
    )
    print(header, flush=True)
    run = cpu_suite if args.suite == "cpu" else gpu_suite  # gpu_suite: gpu-compare
    doc, tables = run(budget, names, out, args.parts)
    wall = time.perf_counter() - started
    footer = f"total wall time: {wall:.0f} s ({wall / 60:.1f} min)"
    print(footer)
    budget["workloads"] = {name: settings(budget, name) for name in names}  # what each one ran with
    doc = {"machine": info, "suite": key, "budget": budget, **doc, "wall_s": wall}
    (out / f"{args.suite}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / f"{args.suite}.md").write_text("\n".join([header, "", *tables, footer]) + "\n")
    print(f"wrote {out / f'{args.suite}.json'} and {out / f'{args.suite}.md'}")


if __name__ == "__main__":
    main()
