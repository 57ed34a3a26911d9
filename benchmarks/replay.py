"""Replay a search strategy on a table of throughputs, without running a trial.

The study loop itself (``autotune.search.study.run_trials``: the baseline first, the claims,
repeats answered from earlier trials, the guard as a constraint, the staged strategy's queue and
refusals) runs on an in-memory Optuna study; its runner looks each configuration up in a table
(configuration key -> samples/s and metric drop) instead of measuring it. For each strategy and
seed: how many measured trials until the best feasible one reaches 95% and 99% of the table's
optimum.

Tables:

* ``text-synthetic``: SYNTHETIC, not measured. The real-text workload's factors (padding x
  length grouping x autocast x compile x runtime/precision x int8 fallback x batch x threads)
  with effect sizes taken from the MiniLM table of issue 26 (a 2-core Xeon with AMX), whose
  effects multiply, with the interaction bf16 x trimmed padding and one thread halving.
* ``quickstart``: part 2's 48 measured configurations (``benchmarks/search.py``), when its cache
  ``search-quickstart.json`` is given with ``--quickstart PATH``.
* ``text``: measured with ``--text OUT``: all-MiniLM-L6-v2 on 384 real sentences pre-padded to
  64 tokens (the issue's workload), padding x length grouping x autocast x batch x threads (32
  configurations, a few minutes), measured once by the tuner's own worker and cached in
  ``OUT/search-text.json`` for the next run on the same machine and software. Compile and ONNX
  Runtime are left out of this table: each of their configurations costs a compile or an
  export. ``--text-full OUT`` measures them too (``search-text-full.json``: compile, ONNX
  Runtime fp32 and int8 with 0 or 4 layers kept float; 84 configurations, about half an hour).

Run: ``python -m benchmarks.replay [--seeds 20] [--trials 24] [--quickstart OUT/search-quickstart.json] [--text OUT] [--text-full OUT]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FRACTIONS = (0.95, 0.99)
STRATEGIES = ("staged", "tpe", "random")


class TableRunner:
    """A runner whose trials look their result up in ``table`` (key -> result attributes)."""

    timeout = 600.0
    deadline = None

    def __init__(self, table: Mapping[str, Mapping[str, Any]]) -> None:
        self.table, self.calls = table, 0

    def run(self, config: dict[str, Any], timeout: float | None = None, fidelity: Any = None) -> Any:
        from autotune.config import Config
        from autotune.trial.spec import TrialResult

        self.calls += 1
        found = self.table.get(Config(config).key())
        if found is None:
            return TrialResult("error", "runtime", "not in the table", {"wall_s": 1.0})
        # A cached result holds every key, None where the trial had no such figure (a trial
        # ruled out before it was timed has no samples/s): the study sees it as a worker sends it.
        return TrialResult.from_attrs({"wall_s": 1.0, **{k: v for k, v in found.items() if v is not None}})


def space_of(values: Mapping[str, list[Any]], threads: int = 2) -> Any:
    """A resolved search space over ``values`` (every other knob at its default)."""
    from autotune.knobs import REGISTRY
    from autotune.search.space import SearchSpace

    base = {n: k.default for n, k in REGISTRY.items()} | {"num_threads": threads}
    return SearchSpace({**{n: [v] for n, v in base.items()}, **values}, base, {})


def configs_of(space: Any) -> dict[str, dict[str, Any]]:
    """Every distinct configuration of ``space`` by key, as the study loop would build it."""
    from autotune.config import Config
    from autotune.knobs import REGISTRY

    names = list(space.searched)
    found = {}
    for combo in itertools.product(*(space.searched[n] for n in names)):
        wanted = {**space.baseline, **dict(zip(names, combo, strict=True))}
        config: dict[str, Any] = {}
        for name, knob in REGISTRY.items():
            config[name] = wanted[name] if knob.applies(config) else space.baseline[name]
        found.setdefault(Config(config).key(), config)
    return found


TEXT_SPACE = {
    "padding": ["as_given", "trim"],
    "length_grouping": [0, 16],
    "amp_dtype": ["float32", "bfloat16"],
    "compile_mode": ["none", "default"],
    "runtime": ["torch", "onnxruntime"],
    "ort_precision": ["fp32", "int8_dynamic"],
    "int8_fallback": [0, "auto"],
    "batch_size": [32, 64, 128],
    "num_threads": [1, 2],
}


def text_throughput(c: Mapping[str, Any]) -> tuple[float, float]:
    """SYNTHETIC samples/s and metric drop of one configuration of TEXT_SPACE (baseline 167/s)."""
    trimmed, grouped = c["padding"] != "as_given", c["length_grouping"] > 0
    x = (2.7 if grouped else 1.6) if trimmed else 1.0
    drop = 0.0
    if c["runtime"] == "onnxruntime":
        x *= 1.1
        if c["ort_precision"] == "int8_dynamic":
            x *= 1.35 if c["int8_fallback"] == 0 else 1.2
            drop = 0.05 if c["int8_fallback"] == 0 else 0.004  # every MatMul in int8 ruins accuracy
    else:
        bf16 = c["amp_dtype"] == "bfloat16"
        x *= 3.3 if bf16 else 1.0
        x *= 0.66 if bf16 and trimmed else 1.0  # bf16 x trimmed padding: less left to gain
        if c["compile_mode"] != "none":
            x *= (1.25 if bf16 else 1.1) * (0.6 if trimmed else 1.0)  # varying shapes recompile
    x *= {32: 1.0, 64: 1.05, 128: 0.9 if trimmed and not grouped else 1.02}[c["batch_size"]]
    x *= 0.5 if c["num_threads"] == 1 else 1.0
    return 167.0 * x, drop


def text_table() -> tuple[Any, dict[str, dict[str, Any]]]:
    """The synthetic real-text table, with a fixed +-2% 'measurement noise' per configuration."""
    space = space_of(TEXT_SPACE)
    table = {}
    for key, config in configs_of(space).items():
        sps, drop = text_throughput(config)
        noise = 1.0 + 0.02 * ((zlib.crc32(key.encode()) % 2001) / 1000.0 - 1.0)
        table[key] = {"status": "ok", "samples_per_s": sps * noise, "metric_drop": drop}
    return space, table


def cached_table(path: str | Path) -> tuple[Any, dict[str, dict[str, Any]]]:
    """A cache of ``benchmarks/search.py``'s measurements (``search-NAME.json``) and the space
    they span (the baseline runs the most threads measured)."""
    doc = json.loads(Path(path).read_text())
    values = {k: v for k, v in doc["fingerprint"]["space"].items() if len(v) > 1}
    threads = max(doc["fingerprint"]["space"].get("num_threads", [2]))
    return space_of(values, threads), doc["results"]


TEXT_MEASURED = {
    "base": None,
    "padding": ["as_given", "trim"],
    "length_grouping": [0, 16],
    "amp_dtype": ["float32", "bfloat16"],
    "batch_size": [32, 64],
    "num_threads": [1, 2],
}


# With torch.compile, ONNX Runtime fp32 and int8 (every layer, or the 4 most sensitive kept
# float): 84 configurations, about half an hour on 2 cores.
TEXT_FULL = {
    **TEXT_MEASURED,
    "compile_mode": ["none", "default"],
    "runtime": ["torch", "onnxruntime"],
    "ort_precision": ["fp32", "int8_dynamic"],
    "int8_fallback": [0, 4],
}


def text_table_measured(out: Path, full: bool = False) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The real-text table (:data:`TEXT_MEASURED`, or :data:`TEXT_FULL`, on MiniLM, 384 real
    sentences pre-padded to 64 tokens), measured by the tuner's worker, or reused from ``out``'s cache."""
    from benchmarks.core import workload
    from benchmarks.search import MEASURE, enumerate_space

    out.mkdir(parents=True, exist_ok=True)
    name = "text-full" if full else "text"  # the cache's name, as earlier runs wrote it
    cfg = workload("text-padded").build()
    enum = enumerate_space(name, cfg, out, TEXT_FULL if full else TEXT_MEASURED, MEASURE)
    print(f"  {name}: {len(enum['results'])} configurations measured in {enum['enumerate_s']:.0f} s", flush=True)
    return cached_table(out / f"search-{name}.json")


def replay(space: Any, table: Mapping[str, Mapping[str, Any]], strategy: str, seed: int, n_trials: int) -> dict:
    """Trials the loop needs to reach each fraction of the optimum (``None``: not within ``n_trials``)."""
    import optuna

    from autotune.search.space import first_params
    from autotune.search.strategy import Staged
    from autotune.search.study import make_sampler, run_trials

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.RandomSampler(seed=seed) if strategy == "random" else make_sampler(seed)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    staged = Staged(space, ["throughput"]) if strategy == "staged" else None
    if strategy == "random":  # no warm start: the baseline, then random
        study.enqueue_trial(first_params(space)[0], user_attrs={"baseline": True})
    run_trials(
        study,
        TableRunner(table),
        space,
        n_trials=n_trials,
        timeout=None,
        max_metric_drop=0.01,
        objectives=["throughput"],
        extra_attrs={},
        strategy=staged,
    )
    feasible = [r["samples_per_s"] for r in table.values() if r["status"] == "ok" and r["metric_drop"] <= 0.01]
    optimum, best, n, reached = max(feasible), 0.0, 0, {}
    for t in study.trials:
        if not t.user_attrs.get("ran") or t.user_attrs.get("repeat_of") is not None:
            continue
        n += 1
        if t.user_attrs.get("status") == "ok":
            best = max(best, t.user_attrs["samples_per_s"])
        reached.update({f: n for f in FRACTIONS if f not in reached and best >= f * optimum})
    return {f: reached.get(f) for f in FRACTIONS}


def quantiles(values: list[float]) -> str:
    """Median [10th-90th percentile]; ``inf`` (never reached) shown as ``>N``."""
    q = statistics.quantiles(values, n=10, method="inclusive")
    fmt = lambda v: "never" if math.isinf(v) else f"{v:g}"  # noqa: E731
    return f"{fmt(statistics.median(values))} [{fmt(q[0])}-{fmt(q[-1])}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--trials", type=int, default=24, help="budget of measured trials per replay")
    parser.add_argument("--quickstart", help="part 2's cache, search-quickstart.json")
    parser.add_argument("--text", type=Path, help="measure the real-text table here (or reuse its cache)")
    parser.add_argument(
        "--text-full", type=Path, help="the same with compile and ONNX Runtime fp32/int8 (about half an hour)"
    )
    args = parser.parse_args(argv)
    tables = {"text-synthetic (SYNTHETIC)": text_table()}
    if args.quickstart:
        tables["quickstart (measured)"] = cached_table(args.quickstart)
    if args.text:
        tables["real text (measured)"] = text_table_measured(args.text)
    if args.text_full:
        tables["real text with compile and ONNX Runtime (measured)"] = text_table_measured(args.text_full, full=True)
    for name, (space, table) in tables.items():
        missing = [k for k in configs_of(space) if k not in table]
        if missing:  # the study would propose configurations the table cannot answer
            raise SystemExit(
                f"{name}: {len(missing)} configurations of its space are not in the table, e.g. {missing[0]}"
            )
        print(f"\n{name}: {len(table)} configurations, budget {args.trials} trials, {args.seeds} seeds")
        print("strategy | trials to 95%: median [p10-p90] | trials to 99%: median [p10-p90]")
        for strategy in STRATEGIES:
            runs = [replay(space, table, strategy, seed, args.trials) for seed in range(args.seeds)]
            cells = [quantiles([math.inf if r[f] is None else r[f] for r in runs]) for f in FRACTIONS]
            print(f"{strategy} | {cells[0]} | {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
