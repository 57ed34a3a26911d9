"""Time to result: a 16-trial run cold (empty compile caches) and warm, ``budget`` runs with a
small and a large ``n_trials`` and of 90 s, their phases' seconds, and every winner re-timed
beside the best hand recipe.

    python -m benchmarks.text.budget                          # text-padded and hf; about 40 minutes
    python -m benchmarks.text.budget --workloads hf           # one workload
    python -m benchmarks.text.budget --load OUT               # re-time the finished runs in OUT
    python -m benchmarks.text.budget --load OUT --again "budget 90 s, 200 trials"   # run one again, re-time all
    python -m benchmarks.text.budget --smoke                  # tiny budgets: checks that it runs

For each workload (``text-padded``: real all-MiniLM-L6-v2 over 384 real sentences pre-padded to
64 tokens; ``hf``: the transformers pipeline of benchmarks/text/hf.py, 300 sentences through
``DataCollatorWithPadding``):

1. Each run of :data:`RUNS` in a fresh process, in order, as a user calls ``autotune.optimize``
   (the default space, on the CPU), with the machine's compile cache in a folder of the
   workload's own (``AUTOTUNE_CACHE_DIR``): emptied before the cold 16-trial run, which fills
   it; every later run reads it, as a user's second run does. The table gives each run's wall
   time as the process saw it, the run's own phases (prepare, search, finish) and the finish's
   share, from ``best_config.json``.
2. A fresh process times, in rounds of rotating order over the whole dataset: the plain fp32
   loop (the model as given, batches of 32 in dataset order), the hand recipe (fp32 eager,
   batches of 32 sorted by length and trimmed to their longest sentence: what an engineer writes
   first for text) and, where the CPU has bf16 units, the same in bf16 autocast (the better of
   the two is the best hand recipe), and each run's winner through ``autotune.apply`` +
   ``autotune.dataloader``.
   Each ratio is the geometric mean over rounds of that round's rate over the plain loop's.

The targets, printed as met or not: the cold 16-trial run in at most 180 s and the warm one in
at most 150 s, each finish at most 25% of its run; the warm 16-trial winner at least 1.1 of the
best hand recipe; ``budget=180`` (with 16 or 200 trials) at least 0.95 of the warm 16-trial
winner and ``budget=90`` at least 0.9, each budget run ending within 10% of its budget and
using at least 80% of it. Nothing here asserts a speed; time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.core import machine, ratios_to, rotating_rounds, table, workload, workloads

ROOT = Path(__file__).resolve().parents[2]
BATCH_SIZE = 32
# The runs, in order: (label, optimize's options). The first is cold (an empty compile cache),
# the rest warm; "warm" is the 16-trial winner the budget runs are compared with.
RUNS = {
    "full": {
        "runs": [
            ("cold", {"n_trials": 16}),
            ("warm", {"n_trials": 16}),
            ("budget 180 s, 16 trials", {"budget": "180s", "n_trials": 16}),
            ("budget 180 s, 200 trials", {"budget": "180s", "n_trials": 200}),
            ("budget 90 s, 200 trials", {"budget": "90s", "n_trials": 200}),
        ],
        "rounds": 7,
        "seconds": 2.0,
    },
    "smoke": {
        "runs": [
            ("cold", {"n_trials": 2}),
            ("warm", {"n_trials": 2}),
            ("budget 40 s", {"budget": "40s", "n_trials": 200}),
        ],
        "rounds": 1,
        "seconds": 0.2,
    },
}
TARGETS = {"cold_s": 180.0, "warm_s": 150.0, "finish_share": 0.25, "of_hand": 1.1, "budget_180": 0.95,
           "budget_90": 0.9, "budget_end": 1.1, "budget_use": 0.8}  # fmt: skip


def tune(name: str, out: str, options: dict[str, Any]) -> None:
    """One run of ``name`` into ``out``, as a user calls it (the default space, on the CPU)."""
    import autotune

    cfg = workload(name).build()
    autotune.optimize(cfg["model"], cfg["dataset"], out_dir=out, device="cpu", **options)


def _run(name: str, out: Path, options: dict[str, Any], cache: Path) -> dict[str, Any]:
    """``tune`` in a fresh process, its compile cache in ``cache``; its wall time and the run's own phases."""
    code = "import json, sys; from benchmarks.text.budget import tune; tune(*json.loads(sys.argv[1]))"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps([name, str(out), options])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "AUTOTUNE_CACHE_DIR": str(cache)},
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"tuning {name} with {options} failed: {done.stderr.strip()[-800:]}")
    return {"wall_s": wall, **_phases(out)}


def _phases(out: Path) -> dict[str, Any]:
    saved = json.loads((out / "best_config.json").read_text())
    changed = {k: v for k, v in (saved.get("config") or {}).items() if saved["baseline_config"].get(k) != v}
    return {
        "time": saved.get("time") or {},
        "finish": saved.get("finish") or [],
        "n_measured": saved.get("n_measured"),
        "stop_reason": saved.get("stop_reason"),
        "claim": (saved.get("speedup") or {}).get("speedup"),
        "winner": ", ".join(f"{k}={v}" for k, v in changed.items()) or "the baseline",
        "compile_s": ((saved.get("search") or {}).get("compile") or {}).get("seconds"),
    }


def _length(sample: Any) -> int:
    mask = sample["attention_mask"]
    return int(sum(mask) if isinstance(mask, list) else mask.sum())


def _trimmed(collate: Any) -> Any:
    """``collate``, then every (batch, seq) tensor cut to the batch's longest sentence."""

    def go(samples: list[Any]) -> Any:
        batch = collate(samples)
        width = batch["attention_mask"].shape[1]
        longest = int(batch["attention_mask"].sum(1).max())
        return {k: v[:, :longest] if v.dim() == 2 and v.shape[1] == width else v for k, v in batch.items()}

    return go


def retime(name: str, outs: list[str], rounds: int, seconds: float) -> dict[str, Any]:
    """In this (fresh) process: the plain loop, the hand recipe and each run's apply + dataloader."""
    import torch

    import autotune
    from autotune.data import call_model
    from autotune.run.apply import _unloaded, base_collate
    from benchmarks.predict import _model
    from benchmarks.text.recipes import bf16_skip_reason

    cfg = workload(name).build()
    data, collate = _unloaded(cfg["dataset"], None)
    plain = torch.utils.data.DataLoader(data, batch_size=BATCH_SIZE, collate_fn=base_collate(data, collate))
    order = sorted(range(len(data)), key=lambda i: _length(data[i]))
    chunks = [order[i : i + BATCH_SIZE] for i in range(0, len(order), BATCH_SIZE)]
    hand = torch.utils.data.DataLoader(data, batch_sampler=chunks, collate_fn=_trimmed(base_collate(data, collate)))
    stock, model = torch.get_num_threads(), _model(cfg)
    runs = {}
    for out in outs:
        tuned = autotune.apply(_model(cfg), out, dataset=data, collate_fn=collate, device="cpu")
        runs[out] = (tuned, autotune.dataloader(data, out, collate_fn=collate), torch.get_num_threads())

    def loop(net: Any, batches: Any, n_threads: int, bf16: bool = False) -> None:
        torch.set_num_threads(n_threads)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for batch in batches:
                call_model(net, batch)

    pipelines = {"plain": lambda: loop(model, plain, stock), "hand": lambda: loop(model, hand, stock)}
    if bf16_skip_reason() is None:
        pipelines["hand bf16"] = lambda: loop(model, hand, stock, bf16=True)
    for out, (tuned, loader, threads) in runs.items():
        pipelines[out] = lambda t=tuned, b=loader, n=threads: loop(t, b, n)
    rates = rotating_rounds(pipelines, len(data), rounds, seconds)
    return {"rates": rates, "ratios": ratios_to(rates, "plain")}


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _budget_s(options: dict[str, Any]) -> float | None:
    from autotune.run.options import parse_duration

    return parse_duration(options["budget"]) if "budget" in options else None


def _against(label: str, options: dict[str, Any], mine: float, hand: float, warm: float) -> str:
    """The run's winner against the best hand recipe (the 16-trial runs) or the warm 16-trial winner."""
    budget = _budget_s(options)
    if budget is None:
        return f"{mine / hand:.2f} of hand" + (
            f" ({_met(mine / hand >= TARGETS['of_hand'])})" if label == "warm" else ""
        )
    target = TARGETS["budget_180"] if budget >= 180 else TARGETS["budget_90"]
    return f"{mine / warm:.2f} of 16 trials ({_met(mine / warm >= target)})"


def _whole(label: str, options: dict[str, Any], wall: float) -> str:
    """The run's wall time, against its target: the 16-trial runs' seconds, a budget's end and use."""
    budget = _budget_s(options)
    if budget is not None:
        ends = wall <= TARGETS["budget_end"] * budget and wall >= TARGETS["budget_use"] * budget
        return f"{wall:.0f} s = {wall / budget:.2f} of its budget ({_met(ends)})"
    limit = TARGETS.get(f"{label}_s")
    return f"{wall:.0f} s" + (f" ({_met(wall <= limit)})" if limit else "")


def report(name: str, runs: dict[str, dict[str, Any]], timed: dict[str, Any]) -> list[list[Any]]:
    ratios = timed["ratios"]
    hand = max(ratios["hand"], ratios.get("hand bf16", 0.0))  # the best hand recipe
    warm = ratios[runs["warm"]["out"]] if "warm" in runs else ratios[next(iter(runs.values()))["out"]]
    rows = []
    for label, run in runs.items():
        t = run["time"]
        share = (t.get("finish_s") or 0.0) / (t.get("total_s") or 1.0)
        mine = ratios[run["out"]]
        rows.append([
            name,
            label,
            _whole(label, run["options"], run["wall_s"]),
            f"{t.get('prepare_s', 0):.0f} / {t.get('search_s', 0):.0f} / {t.get('finish_s', 0):.0f} s",
            f"{share:.0%} ({_met(share <= TARGETS['finish_share'])})",
            f"{run['n_measured']}, {run['stop_reason']}",
            f"{run['claim']:.2f}x" if run.get("claim") else "-",
            f"{mine:.2f}x (hand {hand:.2f}x)",
            _against(label, run["options"], mine, hand, warm),
        ])  # fmt: skip
    return rows


def _tuned(
    name: str, root: Path, plan: dict[str, Any], load: bool, winners: list[str], again: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """Each run of ``plan`` for workload ``name`` in ``root``: run now, or read back with
    ``load`` but for the runs labelled in ``again``, run now on the compile cache the others left."""
    import shutil

    cache = root / name / "compile-cache"
    if not load or plan["runs"][0][0] in again:
        # The first run is a first run on this machine: run again, it must not read what the
        # runs before it left (read so, a "cold" run's compile took 21 s where a first one takes 55).
        shutil.rmtree(cache, ignore_errors=True)
    runs = {}
    for label, options in plan["runs"]:
        out = root / name / label.replace(" ", "-").replace(",", "")
        if load and label not in again:
            run = _phases(out) | {"wall_s": json.loads((out / "wall.json").read_text())["wall_s"]}
        else:
            shutil.rmtree(out, ignore_errors=True)
            run = _run(name, out, options, cache)
            (out / "wall.json").write_text(json.dumps({"wall_s": run["wall_s"]}))
        runs[label] = run | {"out": str(out), "options": options}
        winners.append(f"{name}, {label}: {run['winner']}; finish {run['finish']}; compiling {run['compile_s']} s")
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.text.budget", description=__doc__.split("\n")[0])
    known = [w.name for w in workloads(benchmark="text.budget")]
    parser.add_argument("--workloads", default=",".join(known), help="comma-separated: text-padded, hf")
    parser.add_argument("--out", type=Path, help="directory for the runs (default: a temporary one)")
    parser.add_argument("--load", type=Path, help="re-time the finished runs in this directory; no tuning")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets: checks that everything runs")
    parser.add_argument(
        "--again", default="", help="with --load: run these again (labels, ';'-separated), then re-time all"
    )
    args = parser.parse_args(argv)
    again = tuple(label.strip() for label in args.again.split(";") if label.strip())
    if again and args.load is None:
        parser.error("--again runs named runs again on a finished folder: give it with --load OUT.")
    if unknown := [label for label in again if label not in {lbl for lbl, _ in RUNS["full"]["runs"]}]:
        parser.error(f"No run labelled {unknown[0]!r}. Known: {'; '.join(lbl for lbl, _ in RUNS['full']['runs'])}.")
    if unknown := [n for n in args.workloads.split(",") if n not in known]:
        parser.error(f"No workload named {unknown[0]!r}. Known: {', '.join(known)}.")
    plan = RUNS["smoke" if args.smoke else "full"]
    root = args.load or args.out or Path(tempfile.gettempdir()) / "autotune-bench-budget"
    info = machine()
    print(f"time to result, {info['date']}, {info['cpu']}, {info['cpu_count']} cores")
    rows, winners = [], []
    for name in args.workloads.split(","):
        runs = _tuned(name, root, plan, args.load is not None, winners, again)
        code = "import json, sys; from benchmarks.text.budget import retime; print(json.dumps(retime(*json.loads(sys.argv[1]))))"
        call = [name, [run["out"] for run in runs.values()], plan["rounds"], plan["seconds"]]
        done = subprocess.run([sys.executable, "-c", code, json.dumps(call)], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"re-timing {name} failed: {done.stderr.strip()[-800:]}")
        rows += report(name, runs, json.loads(done.stdout.strip().splitlines()[-1]))
    header = (
        "workload|run|whole run (process)|prepare / search / finish|finish share|trials measured, stop|claimed|"
        "apply + dataloader over the plain loop|against"
    )
    table("Time to result, and the winners re-timed side by side in one fresh process", header, rows)
    print("\n".join(winners))


if __name__ == "__main__":
    main()
