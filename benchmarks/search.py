"""Part 2: search efficiency, on a space small enough to measure whole.

1. Enumerate: every configuration of a small space (batch size x loader workers x autocast dtype
   x torch.compile, about 48) measured once by the tuner's own worker. The measurements are
   cached as JSON in the out dir and reused by the next run on the same hardware and software.
2. Replay: the tuner's loop (as ``autotune.search.study.run_trials`` runs it for one worker: the
   baseline enqueued first, then the warm start of ``autotune.search.space.warm_start``, repeats
   answered from earlier trials, the guard as a constraint) on
   an in-memory study whose objective looks the cached value up, with the tuner's seeded TPE
   sampler (``autotune.search.study.make_sampler``) for many seeds, and with Optuna's RandomSampler
   (the baseline first, no warm start).
3. Report how many measured trials each needs to reach 95% and 99% of the enumerated optimum.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.core import OthersCPU, cpu_model, start_worker, table

SPACE = {
    "base": None,  # only these knobs; every other one stays at its baseline value
    "batch_size": [16, 32, 64, 128, 256, 512],
    "num_workers": [0, 1],
    "amp_dtype": ["float32", "bfloat16"],
    "compile_mode": ["none", "default"],
}
MEASURE = {"n_windows": 3, "window_s": 0.3, "warmup_batches": 3}
FRACTIONS = (0.95, 0.99)
TARGET_SHARE = 0.25  # 95% of the optimum within a quarter of the space's size, median over seeds
RESULT_KEYS = ("status", "kind", "reason", "samples_per_s", "metric", "metric_drop", "compile_s", "latency_ms_p95")


def configs_of(search_space: Any) -> list[dict[str, Any]]:
    """Every configuration of the space: the product of the searched knobs' values."""
    names, values = list(search_space.searched), list(search_space.searched.values())
    return [{**search_space.baseline, **dict(zip(names, combo, strict=True))} for combo in itertools.product(*values)]


def enumerate_space(name: str, cfg: dict, out: Path, space: dict, measure: dict) -> dict[str, Any]:
    """Measure every configuration once, or reuse the cache written by an earlier run here."""
    import autotune
    from autotune.config import Config

    env, _, search_space = autotune.plan(cfg["model"], cfg["dataset"], space=space)
    fingerprint = {
        "workload": name,
        "space": search_space.values,
        "measure": measure,
        "hardware": env.hardware_key(),
        "cpu": cpu_model(),
        "versions": {**env.versions, "autotune": autotune.__version__},
    }
    path = out / f"search-{name}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("fingerprint") == json.loads(json.dumps(fingerprint)):
            print(f"  {name}: reusing the {len(cached['results'])} measurements cached in {path}", flush=True)
            return {**cached, "search_space": search_space, "cached": True}
    configs, results = configs_of(search_space), {}
    others, started = OthersCPU(), time.perf_counter()
    runner, _, _ = start_worker(cfg, out, f"search-{name}", space=space, measure=measure)
    try:
        for i, config in enumerate(configs):
            key = Config(config).key()
            if key in results:  # a knob that does not apply here: measured already
                continue
            r = runner.run(config).to_attrs()
            results[key] = {k: r.get(k) for k in RESULT_KEYS}
            changes = " ".join(f"{k}={config[k]}" for k in search_space.searched)
            sps = f"{r['samples_per_s']:>10,.0f} samples/s" if r.get("samples_per_s") else ""
            print(f"  {name} {i + 1:>2}/{len(configs)} {time.perf_counter() - started:5.0f} s  {changes:<70} {sps}")
    finally:
        runner.close()
    doc = {"fingerprint": fingerprint, "results": results, "enumerate_s": time.perf_counter() - started}
    doc["others_cores"] = others()
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return {**doc, "search_space": search_space, "cached": False}


def replay(results: dict[str, dict], search_space: Any, sampler: Any, max_drop: float, warm: bool) -> dict:
    """Measured trials the tuner's loop needs to reach each fraction of the optimum (None: never).

    The loop of ``autotune.search.study.run_trials`` for one worker, on an in-memory study: the baseline
    enqueued first, each suggestion in the tuner's knob order, a configuration suggested again
    answered from its first measurement (told, but not counted), the guard as the constraint.
    """
    import optuna

    from autotune.config import Config
    from autotune.search.space import first_params
    from autotune.search.study import _MAX_REPEATS, _suggest, _tell
    from autotune.trial.spec import TrialResult

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    # The baseline first; the tuner then measures its warm start (random search does not).
    for params in first_params(search_space)[: None if warm else 1]:
        study.enqueue_trial(params, skip_if_exists=True)
    feasible = [r["samples_per_s"] for r in results.values() if r["status"] == "ok" and r["metric_drop"] <= max_drop]
    optimum, best, seen, reached, repeats = max(feasible), 0.0, set(), {}, 0
    while len(reached) < len(FRACTIONS) and len(seen) < len(results) and repeats < _MAX_REPEATS:
        trial = study.ask()
        key = Config(_suggest(trial, search_space)).key()
        repeats = repeats + 1 if key in seen else 0
        seen.add(key)
        told = _tell(
            study, trial, TrialResult.from_attrs(results[key]), ["throughput"], max_drop
        )  # a large drop: infeasible
        if told.user_attrs["status"] == "ok":
            best = max(best, told.user_attrs["samples_per_s"])
        reached.update({f: len(seen) for f in FRACTIONS if f not in reached and best >= f * optimum})
    return {f: reached.get(f) for f in FRACTIONS}


def _median_iqr(values: list[float], size: int) -> str:
    def fmt(v: float) -> str:
        return f">{size}" if math.isinf(v) else f"{v:g}"

    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{fmt(q2)} [{fmt(q1)}-{fmt(q3)}]"


def efficiency(name: str, cfg: dict, out: Path, *, space: dict, measure: dict, n_seeds: int) -> tuple[dict, str]:
    """Enumerate (or reuse), replay both samplers for ``n_seeds`` seeds, print the tables."""
    import optuna

    from autotune.search.study import make_sampler  # the tuner's seeded TPE settings

    enum = enumerate_space(name, cfg, out, space, measure)
    results, search_space = enum["results"], enum["search_space"]
    max_drop = cfg.get("max_metric_drop", 0.01)
    size = len(results)
    started = time.perf_counter()
    samplers = {"tpe": make_sampler, "random": lambda seed: optuna.samplers.RandomSampler(seed=seed)}
    runs = {
        name: [replay(results, search_space, new(seed), max_drop, warm=name == "tpe") for seed in range(n_seeds)]
        for name, new in samplers.items()
    }
    replay_s = time.perf_counter() - started

    # The landscape: the five fastest configurations that pass the guard, and the baseline.
    from autotune.config import Config

    base_key = Config(search_space.baseline).key()
    ranked = sorted(
        (r["samples_per_s"], k) for k, r in results.items() if r["status"] == "ok" and r["metric_drop"] <= max_drop
    )[::-1]
    optimum = ranked[0][0]
    rows = []
    top = (
        ranked[:5]
        if base_key in (k for _, k in ranked[:5])
        else [*ranked[:5], (results[base_key]["samples_per_s"], base_key)]
    )
    for sps, key in top:
        knobs = json.loads(key)
        label = " ".join(f"{k}={knobs.get(k)}" for k in search_space.searched) + (
            " (baseline)" if key == base_key else ""
        )
        rows.append([label, f"{sps:,.0f}", f"{sps / optimum:.2f}", f"{results[key]['metric_drop']:+.4f}"])
    n_ok = len(ranked)
    how = "reused from the cache" if enum["cached"] else f"measured in {enum['enumerate_s']:.0f} s"
    text = table(
        f"Search space: {name}, {size} configurations ({n_ok} pass the guard), {how}",
        "configuration|samples/s|of the optimum|metric drop",
        rows,
    )

    summary, cells = {}, []
    for sampler, per_seed in runs.items():
        summary[sampler] = {}
        row = [sampler.upper() if sampler == "tpe" else "random", n_seeds]
        for f in FRACTIONS:
            values = [math.inf if r[f] is None else r[f] for r in per_seed]
            summary[sampler][f] = values
            row.append(_median_iqr(values, size))
        row.append(sum(r[FRACTIONS[-1]] is not None for r in per_seed))
        cells.append(row)
    goal = TARGET_SHARE * size
    tpe_95 = statistics.median(summary["tpe"][FRACTIONS[0]])
    met = tpe_95 <= goal
    text += "\n" + table(
        f"Search efficiency: measured trials to reach a share of the optimum ({size} configurations), "
        f"replayed in {replay_s:.0f} s",
        "sampler|seeds|trials to 95%: median [IQR]|trials to 99%: median [IQR]|seeds reaching 99%",
        cells,
    )
    line = (
        f"Target: 95% of the optimum within {TARGET_SHARE:.0%} of the space ({goal:g} trials), median over seeds, "
        f"with the tuner's sampler: {'met' if met else 'not met'} ({tpe_95:g})."
    )
    print(line + "\n", flush=True)
    doc = {k: v for k, v in enum.items() if k != "search_space"}
    doc.update(n_configs=size, optimum=optimum, replay=summary, target_trials=goal, target_met=met, replay_s=replay_s)
    return doc, text + "\n" + line + "\n"
