"""What profiling costs a run: the quickstart's default run with profile=True and profile=False.

    python -m benchmarks.profile_cost            # the quickstart's own run, twice; a few minutes
    python -m benchmarks.profile_cost --pairs 2  # two pairs, the order swapped in the second
    python -m benchmarks.profile_cost --smoke    # CI: a tiny budget, checks that it runs

Both runs are made in this one process, one after the other, with the same options (the
cfg.py's, plus the ones below); only ``profile`` differs. A pair's ratio is the profiled run's
wall time over the other's; profiling's own seconds are those the run recorded (``wall_s`` of
``profile`` in best_config.json: both pipelines built again in the worker and profiled), and in
brackets the profiled windows alone (their ``profile_s``). Nothing here asserts a
speed: it prints the overhead beside its target (at most 10% of a default run's wall time).
Run it on a quiet machine: the trials' timing, not profiling, is most of either run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.core import machine, table, workload

TARGET = 0.10  # profiling may add at most this share to a default run's wall time
# The run's own settings, not the workload's: a full run sets none (the cfg.py's own budget and optimize's
# default timing: the run a user gets).
RUNS: dict[str, dict[str, Any]] = {
    "full": {},
    "smoke": {
        "n_trials": 1,
        "n_verify_pairs": 1,
        "measure": {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        "export": (),
    },
}


def one_run(cfg: dict[str, Any], out: Path, profile: bool, budget: dict[str, Any]) -> dict[str, Any]:
    """Tune ``cfg`` into ``out``; return the wall time and what profiling recorded."""
    import autotune

    shutil.rmtree(out, ignore_errors=True)
    options = {**(cfg.get("options") or {}), **budget, "out_dir": out, "profile": profile, "progress": False}
    kwargs = {k: cfg[k] for k in ("metric", "max_metric_drop", "space") if k in cfg}
    started = time.perf_counter()
    autotune.optimize(cfg["model"], cfg["dataset"], **{**kwargs, **options})
    wall_s = time.perf_counter() - started
    found = json.loads((out / "best_config.json").read_text()).get("profile") or {}
    if "best" in found:
        windows = [found["baseline"]] + ([] if found.get("same") else [found["best"]])
        window_s = sum(w.get("profile_s") or 0.0 for w in windows)
        return {"wall_s": wall_s, "profile_s": found.get("wall_s", window_s), "window_s": window_s, "error": None}
    return {"wall_s": wall_s, "profile_s": None, "window_s": None, "error": found.get("error") if profile else None}


def measure(cfg: dict[str, Any], out: Path, n_pairs: int, budget: dict[str, Any]) -> list[dict[str, Any]]:
    """``n_pairs`` pairs of runs, the profiled one second in even pairs and first in odd ones, so
    that a process warming up (imports, caches) does not count against one side only."""
    pairs = []
    for i in range(n_pairs):
        pair: dict[str, Any] = {}
        for profile in (False, True) if i % 2 == 0 else (True, False):
            label = "on" if profile else "off"
            pair[label] = one_run(cfg, out / f"pair{i}-{label}", profile, budget)
        pair["ratio"] = pair["on"]["wall_s"] / pair["off"]["wall_s"]
        pairs.append(pair)
    return pairs


def rows(pairs: list[dict[str, Any]]) -> list[list[Any]]:
    """One table row per pair."""
    out = []
    for i, p in enumerate(pairs):
        on, off = p["on"], p["off"]
        if on["profile_s"] is not None:
            spent = f"{on['profile_s']:.1f} s (windows {on.get('window_s') or on['profile_s']:.1f} s)"
        else:
            spent = f"not profiled: {on['error']}"
        out.append([i + 1, f"{off['wall_s']:.1f} s", f"{on['wall_s']:.1f} s", f"{p['ratio']:.3f}", spent])
    return out


def verdict(pairs: list[dict[str, Any]]) -> str:
    """Profiling's own seconds over the rest of the profiled run, beside its target, and the
    whole runs' ratio. The runs' other work is the same, but which trials the search runs
    follows its timings, so two runs' walls differ by more than profiling costs (two unprofiled
    runs of the quickstart took 220.6 s and 182.3 s): the ratio of walls is printed as a check,
    the measured seconds decide."""
    spent = [p["on"]["profile_s"] / (p["on"]["wall_s"] - p["on"]["profile_s"]) for p in pairs if p["on"]["profile_s"]]
    ratio = statistics.median(p["ratio"] for p in pairs) - 1
    walls = f"; the whole runs' wall times differ by {ratio:+.1%} (median over pairs), mostly the search's own variance"
    if not spent:
        return "profiling's overhead: not measured (no run was profiled)" + walls
    overhead = statistics.median(spent)
    seconds = statistics.median(p["on"]["profile_s"] for p in pairs if p["on"]["profile_s"])
    met = "met" if overhead <= TARGET else "not met"
    return (
        f"profiling's overhead: {seconds:.1f} s, {overhead:+.1%} of the rest of the run "
        f"(target <= {TARGET:.0%}: {met})" + walls
    )


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1, help="pairs of runs (profile on and off); default 1")
    parser.add_argument("--smoke", action="store_true", help="tiny budget: checks that everything runs")
    parser.add_argument("--out", type=Path, help="directory for the runs (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    budget = RUNS["smoke" if args.smoke else "full"]
    info = machine()
    print(f"profile=True vs profile=False on the quickstart, {info['date']}, {info['cpu']}, {info['cpu_count']} cores")
    out = args.out or Path(tempfile.mkdtemp(prefix="autotune-bench-profile-"))
    try:
        pairs = measure(workload("quickstart").build(), out, args.pairs, budget)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    header = "pair|wall, profile=False|wall, profile=True|ratio|profiling (its windows)"
    table("A run's wall time with and without profiling (quickstart)", header, rows(pairs))
    print(verdict(pairs), flush=True)


if __name__ == "__main__":
    main()
