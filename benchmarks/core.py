"""Core benchmarks of autotune on this machine, measured side by side in one run.

    python -m benchmarks.core              # about 5 minutes on 2 CPU cores
    python -m benchmarks.core --quick      # smoke test: 2 trials, short windows, quickstart only

Three tables, printed as Markdown (readable in a terminal, pasteable into docs/benchmarks.md):

(a) tuned vs baseline: each example tuned with a fixed trial budget; the speedup is optimize()'s
    interleaved re-measurement (median of the best/baseline pair ratios, with min-max).
(b) measurement spread: one configuration (quickstart's baseline) measured five times.
(c) per-trial overhead: seconds of a trial spent outside its timed windows, with a reused worker
    and with a fresh one (worker start included).

Nothing here asserts a speed: targets are printed as PASS/MISS, and everything is saved as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import autotune

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("quickstart", "digits")
SPREAD_TARGET = 0.05  # coefficient of variation of repeated measurements of one configuration
OVERHEAD_TARGET_S = 2.0  # seconds per trial outside the timed windows, reused worker
QUICK_MEASURE = {"n_windows": 3, "window_s": 0.1, "warmup_batches": 2}
TRIAL_TIMEOUT_S = 180.0


def table(title: str, header: str, rows: list[list[Any]]) -> None:
    """Print a Markdown table; ``header`` is the column names joined by '|'."""
    names = header.split("|")
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(n), *(len(r[i]) for r in cells)) for i, n in enumerate(names)]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    print(f"\n### {title}\n\n{line(names)}\n|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print("\n".join(line(r) for r in cells) + "\n", flush=True)


def cpu_model() -> str:
    try:
        rows = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "?"
    return next((r.split(":", 1)[1].strip() for r in rows if r.startswith("model name")), "?")


def machine() -> dict[str, Any]:
    """Where the numbers come from: device, CPU model, cores, memory, versions."""
    from autotune.env import Env

    env = Env.detect("auto")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": env.device,
        "gpu": env.gpu_name,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": env.cpu_capability,
        "mem_gib": round(env.device_mem_bytes / 2**30, 1),
        "versions": env.versions,
    }


class OthersCPU:
    """Cores kept busy by other processes since the last call (0.0 on an otherwise idle machine).

    The timed windows share the cores with whatever else runs; on a shared machine that is the
    first suspect of any spread, so every section reports it. Ours are this process and all its
    descendants: trial workers, their loader workers and torch.compile's compile workers.
    """

    def __init__(self) -> None:
        self.last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        import psutil

        cpu, me = psutil.cpu_times(), psutil.Process()
        busy = sum(cpu) - cpu.idle - getattr(cpu, "iowait", 0.0)
        ours = sum(me.cpu_times()[:4])  # user, system and those of reaped children
        for child in me.children(recursive=True):
            try:
                ours += sum(child.cpu_times()[:4])
            except psutil.Error:  # it ended meanwhile
                pass
        return time.perf_counter(), busy, ours

    def __call__(self) -> float:
        (t0, busy0, ours0), (t1, busy1, ours1) = self.last, self._sample()
        self.last = (t1, busy1, ours1)
        return max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (t1 - t0)


# -----------------------------------------------------------------------------
# (a) tuned vs baseline


def tune_example(name: str, n_trials: int, space: str, measure: dict | None, n_pairs: int, out: Path) -> dict:
    """Tune examples/<name>.py with a fixed trial budget; return its row of table (a)."""
    path = ROOT / "examples" / f"{name}.py"
    if not path.exists():
        return {"example": name, "skipped": f"examples/{name}.py not found"}
    cfg = autotune.load_config(path)
    out_dir = out / name
    shutil.rmtree(out_dir, ignore_errors=True)  # left by an earlier run: its study would refuse to restart
    others, started = OthersCPU(), time.perf_counter()

    def progress(rec: dict, n_done: int, n_total: int) -> None:
        sps = f"{rec['samples_per_s']:>10,.0f} samples/s" if rec.get("samples_per_s") else ""
        print(
            f"  {name} trial {n_done:>2}/{n_total} {time.perf_counter() - started:5.0f} s  "
            f"{rec.get('status', '?'):<10} {sps}",
            flush=True,
        )

    # The example's own options hold, except the budget: fixed here so every run compares like with like.
    options = {
        **cfg.get("options", {}),
        "space": space,
        "n_trials": n_trials,
        "timeout": None,
        "out_dir": out_dir,
        "measure": measure,
        "n_verify_pairs": n_pairs,
        "trial_timeout": TRIAL_TIMEOUT_S,
        "progress": progress,
    }
    max_drop = cfg.get("max_metric_drop", 0.01)
    result = autotune.optimize(
        cfg["model"], cfg["dataset"], metric=cfg.get("metric"), max_metric_drop=max_drop, **options
    )
    base_config = json.loads((out_dir / "best_config.json").read_text())["baseline_config"]
    # Every measured trial's time outside its windows: compiled candidates pay their compilation here.
    measured = [t.user_attrs for t in result.study.trials if t.user_attrs.get("ran") and "wall_s" in t.user_attrs]
    return {
        "example": name,
        "space": space,
        "n_trials": n_trials,
        "baseline_samples_per_s": result.baseline["samples_per_s"],
        "tuned_samples_per_s": result.best["samples_per_s"],
        "speedup": result.speedup,
        "speedup_min": result.speedup_min,
        "speedup_max": result.speedup_max,
        "baseline_metric": result.baseline["metric"],
        "metric_drop": result.best["metric_drop"],
        "max_metric_drop": max_drop,
        "changed": {k: v for k, v in result.best_config.items() if base_config.get(k) != v},
        "tune_s": time.perf_counter() - started,
        "others_cores": others(),
        "trial_overheads": [
            {
                "wall_s": t["wall_s"],
                "timed_s": t["timed_s"],
                "warmup_s": t["compile_s"],
                "guard_s": t.get("guard_s", 0.0),
            }
            for t in measured
        ],
    }


def print_examples(rows: list[dict]) -> None:
    cells = []
    for r in rows:
        if "skipped" in r:
            cells.append([r["example"], *["-"] * 9, r["skipped"]])
            continue
        changed = " ".join(f"{k}={v}" for k, v in r["changed"].items()) or "(the baseline)"
        cells.append(
            [
                r["example"],
                r["space"],
                r["n_trials"],
                f"{r['baseline_samples_per_s']:,.0f}",
                f"{r['tuned_samples_per_s']:,.0f}",
                f"{r['tuned_samples_per_s'] / r['baseline_samples_per_s']:.2f}x",
                f"{r['speedup']:.2f}x [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}]",
                f"{r['metric_drop']:+.4f} (<= {r['max_metric_drop']:g})",
                f"{r['tune_s']:.0f}",
                f"{r['others_cores']:.2f}",
                changed,
            ]
        )
    table(
        "(a) tuned vs baseline",
        "example|space|trials|baseline samples/s|tuned samples/s|ratio in trials|"
        "speedup, interleaved [min-max]|metric drop (allowed)|tuning s|others' cores|best config's changes",
        cells,
    )


# -----------------------------------------------------------------------------
# (b) spread and (c) overhead: one worker runs quickstart's baseline 1 + n_repeats times


def repeat_baseline(measure: dict | None, n_repeats: int, out: Path) -> dict:
    """Start a worker and run quickstart's baseline on it 1 + ``n_repeats`` times.

    The first run, timed together with the worker's start, is the fresh-worker trial of (c);
    the next ``n_repeats`` are the repeated measurements of (b) and the reused-worker trials of (c).
    """
    from autotune._optimize import _DEFAULT_MEASURE, plan
    from autotune._worker import WorkerSpec
    from autotune.data import validation_indices
    from autotune.measure import MeasureSettings
    from autotune.runner import SubprocessRunner, pickle_spec

    cfg = autotune.load_config(ROOT / "examples" / "quickstart.py")
    env, data, space = plan(cfg["model"], cfg["dataset"])
    # The spec optimize() would send (quickstart's dataset is a list, not a factory).
    spec = WorkerSpec(
        model=cfg["model"],
        dataset=cfg["dataset"],
        metric=cfg.get("metric"),
        device=env.device,
        baseline=space.baseline,
        val_indices=validation_indices(data.n_samples, 512),
        measure=MeasureSettings(**{**_DEFAULT_MEASURE, **(measure or {})}),
    )
    payload = pickle_spec(spec)
    others, started = OthersCPU(), time.perf_counter()
    runner = SubprocessRunner(payload, TRIAL_TIMEOUT_S, out / "logs" / "bench-worker.log")
    start_s = time.perf_counter() - started
    try:
        first = runner.run(space.baseline)
        fresh_s = time.perf_counter() - started
        repeats = [runner.run(space.baseline) for _ in range(n_repeats)]
    finally:
        runner.close()
    failed = [r for r in (first, *repeats) if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"quickstart's baseline failed in the benchmark's worker: {failed[0].get('reason')}")
    return {
        "config": space.baseline,
        "start_s": start_s,
        "fresh_s": fresh_s,
        "first": first,
        "repeats": repeats,
        "others_cores": others(),
    }


def spread(runs: dict) -> dict:
    sps = [r["samples_per_s"] for r in runs["repeats"]]
    mean = statistics.fmean(sps)
    cov = statistics.stdev(sps) / mean  # sample standard deviation over the mean
    verdict = f"{'PASS' if cov <= SPREAD_TARGET else 'MISS'} (target <= {SPREAD_TARGET:.0%})"
    rows = [[i + 1, f"{r['samples_per_s']:,.0f}", f"{r['cov']:.1%}"] for i, r in enumerate(runs["repeats"])]
    rows.append(["all", f"{mean:,.0f} (mean)", f"{cov:.1%} across runs: {verdict}"])
    table(
        f"(b) measurement spread: quickstart baseline, {len(sps)} runs (others' cores {runs['others_cores']:.2f})",
        "run|samples/s (median window)|CoV (within a run, over windows)",
        rows,
    )
    return {
        "samples_per_s": sps,
        "mean": mean,
        "cov": cov,
        "target": SPREAD_TARGET,
        "pass": cov <= SPREAD_TARGET,
        "others_cores": runs["others_cores"],
    }


def split(wall_s: float, timed_s: float, warmup_s: float, guard_s: float, start_s: float = 0.0) -> dict:
    """A trial's seconds outside its timed windows, by cause; the rest is build, size and pipes."""
    over = wall_s - timed_s
    return {
        "wall_s": wall_s,
        "timed_s": timed_s,
        "overhead_s": over,
        "start_s": start_s,
        "warmup_s": warmup_s,
        "guard_s": guard_s,
        "rest_s": over - start_s - warmup_s - guard_s,
    }


def overhead(runs: dict, examples: list[dict]) -> dict:
    first = runs["first"]
    fresh = split(runs["fresh_s"], first["timed_s"], first["compile_s"], first["guard_s"], runs["start_s"])
    reused = [split(r["wall_s"], r["timed_s"], r["compile_s"], r["guard_s"]) for r in runs["repeats"]]
    worst = max(r["overhead_s"] for r in reused)
    named = [("fresh: start + 1st trial", fresh), *((f"reused: trial {i + 1}", r) for i, r in enumerate(reused))]
    # For scale: the trials of (a), where compiled candidates pay for their compilation in the warm-up.
    studies = {}
    for ex in examples:
        trials = sorted((split(**t) for t in ex.get("trial_overheads", [])), key=lambda r: r["overhead_s"])
        if trials:
            studies[ex["example"]] = trials
            named += [
                (f"(a) {ex['example']}: median of {len(trials)}", trials[len(trials) // 2]),
                (f"(a) {ex['example']}: worst of {len(trials)}", trials[-1]),
            ]
    keys = ("wall_s", "timed_s", "overhead_s", "start_s", "warmup_s", "guard_s", "rest_s")
    rows = [[name, *(f"{r[k]:.2f}" for k in keys)] for name, r in named]
    verdict = f"{'PASS' if worst <= OVERHEAD_TARGET_S else 'MISS'} (target <= {OVERHEAD_TARGET_S:g} s)"
    rows.insert(len(reused) + 1, ["reused: worst", "", "", f"{worst:.2f}", verdict, "", "", ""])
    table(
        f"(c) per-trial overhead outside the timed windows, seconds (others' cores {runs['others_cores']:.2f})",
        "worker|wall|timed|overhead|of which: worker start|warm-up|guard|build, size, pipes",
        rows,
    )
    return {
        "fresh": fresh,
        "reused": reused,
        "worst_reused_s": worst,
        "target_s": OVERHEAD_TARGET_S,
        "pass": worst <= OVERHEAD_TARGET_S,
        "study_trials": studies,
    }


# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.core", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12, help="trials per example (default 12)")
    parser.add_argument("--space", help="search space preset (default: cpu on a CPU, default on a GPU)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 trials, short windows, quickstart only")
    parser.add_argument("--out", type=Path, help="directory for benchmarks.json and the studies (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be at least 1, but got {args.trials}")
    out = args.out or Path(tempfile.mkdtemp(prefix="autotune-bench-"))
    out.mkdir(parents=True, exist_ok=True)

    info = machine()
    # On a CPU, the cpu preset: it compiles in torch.compile's default mode only (max-autotune
    # alone could spend the whole budget); --quick uses the quick preset, which never compiles.
    space = args.space or ("quick" if args.quick else "cpu" if info["device"] == "cpu" else "default")
    n_trials, measure, n_pairs = (2, QUICK_MEASURE, 2) if args.quick else (args.trials, None, 5)
    v = info["versions"]
    print(
        f"autotune benchmarks, {info['date']}, {'quick' if args.quick else 'full'}\n"
        f"{info['device']}: {info['gpu'] or info['cpu']}, {info['cpu_count']} cores, {info['cpu_capability']}, "
        f"{info['mem_gib']} GiB; python {v['python']}, torch {v['torch']}, optuna {v['optuna']}\n"
        f"load average (1 min): {os.getloadavg()[0]:.2f}; 'others' cores' below = CPU used by other processes",
        flush=True,
    )

    rows = [tune_example(n, n_trials, space, measure, n_pairs, out) for n in EXAMPLES[: 1 if args.quick else None]]
    print_examples(rows)
    runs = repeat_baseline(measure, 5, out)
    results = {
        "machine": info,
        "quick": args.quick,
        "examples": rows,
        "spread": spread(runs),
        "overhead": overhead(runs, rows),
    }
    (out / "benchmarks.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {out / 'benchmarks.json'}")


if __name__ == "__main__":
    main()
