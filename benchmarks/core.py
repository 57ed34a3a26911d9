"""What every benchmark shares (the workload contract and its registry, Markdown tables, the
machine's description, other processes' CPU use, a trial worker started the way ``optimize``
starts one) and the suite's third part, measurement quality:

- spread: one configuration measured ``n`` times on one reused worker; the coefficient of
  variation of those measurements (target <= 5%);
- overhead: seconds of a trial spent outside its timed windows, on a fresh worker (its start
  included) and on a reused one (target <= 2 s), plus the tuning trials of part 1 for scale.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SPREAD_TARGET = 0.05  # coefficient of variation of repeated measurements of one configuration
OVERHEAD_TARGET_S = 2.0  # seconds per trial outside the timed windows, reused worker
TRIAL_TIMEOUT_S = 300.0


# -----------------------------------------------------------------------------
# the workload contract: one type, one registry

MODES = ("inference", "train")
DEVICES = ("cpu", "cuda")
# A CPU workload's timing on 2 cores: 3 windows instead of optimize's 5, so a transformer trial at
# batch 128 (about a second per batch) takes seconds, not half a minute.
CPU_MEASURE = {"n_windows": 3, "window_s": 0.4, "warmup_batches": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A model and its data as every benchmark gets them: one name, one build, its defaults.

    ``build(**options)`` returns the dict a cfg.py defines: ``model`` (a module or a factory) and
    ``dataset``, and where the workload has them ``metric``, ``max_metric_drop``, ``loss_fn``
    (which mode ``train`` needs), ``train_dataset``, ``test_dataset`` and ``options``
    (``collate_fn``, ``n_val``). Its options are keywords with defaults (``n``: how many
    samples), so ``build()`` is the workload as the benchmarks run it. Building may train a model
    or read weights: it happens when a benchmark asks, never when the workload is registered.

    Attributes:
        name: Unique across families: what command lines take and tables print.
        family: The folder whose ``__init__.py`` registers it (``cpu``, ``gpu``, ``text``, ``vision``).
        description: One line.
        build: Returns the cfg dict above.
        n_trials: The default search budget in each of its modes.
        modes: What it is tuned for: ``inference``, ``train`` or both.
        device: What it needs: ``cpu`` (any machine) or ``cuda``.
        measure: Its default timing (``MeasureSettings`` fields); ``None``: optimize's own.
        benchmarks: Those that run it when not told which: ``python -m benchmarks.<name>``,
            ``run.<suite>`` for ``python -m benchmarks.run --suite <suite>``.
        extras: What a benchmark needs beside the cfg dict (``unit``: what one sample is).
    """

    name: str
    family: str
    description: str
    build: Callable[..., dict[str, Any]]
    n_trials: Mapping[str, int]
    modes: tuple[str, ...] = ("inference",)
    device: str = "cpu"
    measure: Mapping[str, Any] | None = None
    benchmarks: tuple[str, ...] = ()
    extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        rules = [  # (holds, what must hold, what was given)
            (re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", self.name), "a lower-case name, no commas or spaces", "that name"),
            (self.description and "\n" not in self.description, "a one-line description", repr(self.description)),
            (callable(self.build), "a callable build", f"build={self.build!r}"),
            (self.modes and set(self.modes) <= set(MODES), f"modes among {', '.join(MODES)}", f"{self.modes}"),
            (self.device in DEVICES, f"a device among {', '.join(DEVICES)}", repr(self.device)),
            (set(self.n_trials) == set(self.modes), "a trial budget for each of its modes", f"{dict(self.n_trials)}"),
            (all(isinstance(n, int) and n >= 1 for n in self.n_trials.values()), "budgets of 1 trial or more",
             f"{dict(self.n_trials)}"),
        ]  # fmt: skip
        for holds, what, given in rules:
            if not holds:
                raise ValueError(f"Workload {self.name!r} needs {what}, but has {given}.")

    def trials(self, mode: str = "inference") -> int:
        """The default number of trials to tune it for ``mode``."""
        if mode not in self.n_trials:
            raise ValueError(f"Workload {self.name!r} is tuned for {', '.join(self.modes)}, not {mode}.")
        return self.n_trials[mode]


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    """Add ``workload`` to :data:`WORKLOADS` (a family's ``__init__.py`` does, once for each)."""
    known = WORKLOADS.get(workload.name)
    if known is not None and known is not workload:
        raise ValueError(
            f"Workload names are unique across families, but {workload.name!r} ({workload.family}) is "
            f"registered already ({known.family}: {known.description}). Give it another name."
        )
    WORKLOADS[workload.name] = workload
    return workload


def _discover() -> None:
    """Import every family's folder, as a runner lists them: each registers its workloads."""
    for init in sorted(Path(__file__).parent.glob("*/__init__.py")):
        importlib.import_module(f"benchmarks.{init.parent.name}")


def workloads(
    *, family: str | None = None, device: str | None = None, mode: str | None = None, benchmark: str | None = None
) -> list[Workload]:
    """The registered workloads that match every filter given, in the order they were registered.

    Example:
        >>> [w.name for w in workloads(benchmark="run.cpu")]
        ['digits', 'transformer', 'lstm']
    """
    _discover()
    return [
        w
        for w in WORKLOADS.values()
        if family in (None, w.family)
        and device in (None, w.device)
        and (mode is None or mode in w.modes)
        and (benchmark is None or benchmark in w.benchmarks)
    ]


def workload(name: str) -> Workload:
    """The registered workload ``name``; ``ValueError`` naming the known ones when there is none."""
    _discover()
    if name not in WORKLOADS:
        raise ValueError(f"No workload named {name!r}. Known: {', '.join(WORKLOADS)}.")
    return WORKLOADS[name]


def table(title: str, header: str, rows: list[list[Any]]) -> str:
    """Print a Markdown table and return it; ``header`` is the column names joined by '|'."""
    names = header.split("|")
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(n), *(len(r[i]) for r in cells)) for i, n in enumerate(names)]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    text = "\n".join([f"### {title}", "", line(names), rule, *(line(r) for r in cells)]) + "\n"
    print("\n" + text, flush=True)
    return text


def interleaved(runner: Any, configs: list[dict[str, Any]], n_rounds: int) -> list[list[float]]:
    """Samples/s of ``configs`` in ``n_rounds`` interleaved rounds in the runner's worker, order
    alternating (what ``optimize`` uses for its own selection rounds): one row per round."""
    measured = runner.call("rounds", configs, n_rounds, n_rounds, None, None, False, n_trials=len(configs) * n_rounds)[
        "rounds"
    ]
    return [[c["samples_per_s"] for c in row] for row in measured]


def spread_of(values: list[float]) -> str:
    """'median [min-max]' of ratios."""
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


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
        "bf16": env.bf16,
        "mem_gib": round(env.device_mem_bytes / 2**30, 1),
        "hardware": env.hardware_key(),
        "versions": env.versions,
    }


class OthersCPU:
    """Cores kept busy by other processes since the last call (0.0 on an otherwise idle machine).

    The timed windows share the cores with whatever else runs; on a shared machine that is the
    first suspect of any spread, so every table reports it. Ours are this process and all its
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


def start_worker(
    cfg: dict[str, Any],
    out: Path,
    name: str,
    *,
    space: Any = "default",
    measure: dict | None = None,
    train: dict[str, Any] | None = None,
) -> tuple[Any, Any, Any]:
    """A trial worker for a workload (a dict as a cfg.py defines), started with the spec
    ``optimize`` would send it, so its trials are the tuner's own.

    Args:
        train: For a training worker: ``optimizer`` and ``effective_batch_size`` (the workload's
            ``loss_fn`` is the loss).

    Returns:
        ``(runner, search_space, env)``; the caller closes the runner.
    """
    import autotune
    from autotune.run.options import DEFAULT_MEASURE as _DEFAULT_MEASURE
    from autotune.run.options import Options
    from autotune.run.stages import worker_spec
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.runner import SubprocessRunner, pickle_spec

    plan_options, spec_options = {}, {}
    if train is not None:
        effective = train["effective_batch_size"]
        plan_options = {"mode": "train", "effective_batch_size": effective, "baseline_batch_size": effective}
        spec_options = {"mode": "train", "loss_fn": cfg["loss_fn"], "optimizer": train["optimizer"]}
        spec_options["effective_batch_size"] = effective
    collate = cfg.get("options", {}).get("collate_fn")
    env, data, search_space = autotune.plan(
        cfg["model"], cfg["dataset"], space=space, collate_fn=collate, **plan_options
    )
    # The spec optimize would send (token sequences batched by the padding knobs, images by the
    # image knobs, the user's collate): a spec of its own had left length grouping without lengths.
    opts = Options(
        metric=cfg.get("metric"),
        max_metric_drop=cfg.get("max_metric_drop", 0.01),
        n_val=cfg.get("options", {}).get("n_val", 512),
        collate_fn=collate,
        **spec_options,
    )
    timing = MeasureSettings(**{**_DEFAULT_MEASURE, **(measure or {})})
    spec = worker_spec(cfg["model"], cfg["dataset"], opts, env, search_space, data, timing)
    runner = SubprocessRunner(pickle_spec(spec), TRIAL_TIMEOUT_S, out / "logs" / f"{name}.log")
    return runner, search_space, env


# -----------------------------------------------------------------------------
# measurement quality


def repeat_baseline(cfg: dict[str, Any], name: str, measure: dict | None, n_repeats: int, out: Path) -> dict:
    """Start a worker and run the workload's baseline on it 1 + ``n_repeats`` times.

    The first run, timed together with the worker's start, is the fresh-worker trial; the next
    ``n_repeats`` are the repeated measurements and the reused-worker trials.
    """
    others, started = OthersCPU(), time.perf_counter()
    runner, space, _ = start_worker(cfg, out, f"quality-{name}", measure=measure)
    start_s = time.perf_counter() - started
    try:
        first = runner.run(space.baseline).to_attrs()
        fresh_s = time.perf_counter() - started
        repeats = [runner.run(space.baseline).to_attrs() for _ in range(n_repeats)]
    finally:
        runner.close()
    failed = [r for r in (first, *repeats) if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"{name}'s baseline failed in the benchmark's worker: {failed[0].get('reason')}")
    times = {"start_s": start_s, "fresh_s": fresh_s, "others_cores": others()}
    return {"workload": name, "first": first, "repeats": repeats, **times}


def spread(runs: dict) -> tuple[dict, str]:
    sps = [r["samples_per_s"] for r in runs["repeats"]]
    mean = statistics.fmean(sps)
    cov = statistics.stdev(sps) / mean  # sample standard deviation over the mean
    verdict = f"{'PASS' if cov <= SPREAD_TARGET else 'MISS'} (target <= {SPREAD_TARGET:.0%})"
    rows = [[i + 1, f"{r['samples_per_s']:,.0f}", f"{r['cov']:.1%}"] for i, r in enumerate(runs["repeats"])]
    rows.append(["all", f"{mean:,.0f} (mean)", f"{cov:.1%} across runs: {verdict}"])
    text = table(
        f"Measurement spread: {runs['workload']} baseline, {len(sps)} runs (others' cores {runs['others_cores']:.2f})",
        "run|samples/s (median window)|CoV (within a run, over windows)",
        rows,
    )
    result = {"samples_per_s": sps, "mean": mean, "cov": cov, "target": SPREAD_TARGET, "pass": cov <= SPREAD_TARGET}
    return result, text


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


def trial_overheads(study: Any) -> list[dict]:
    """The split of every measured trial of a tuning study (compiled ones pay compilation here)."""
    ran = [t.user_attrs for t in study.trials if t.user_attrs.get("ran") and "wall_s" in t.user_attrs]
    return [split(t["wall_s"], t["timed_s"], t["compile_s"], t.get("guard_s", 0.0)) for t in ran if "timed_s" in t]


def overhead(runs: dict, studies: dict[str, list[dict]]) -> tuple[dict, str]:
    first = runs["first"]
    fresh = split(runs["fresh_s"], first["timed_s"], first["compile_s"], first["guard_s"], runs["start_s"])
    reused = sorted(
        (split(r["wall_s"], r["timed_s"], r["compile_s"], r["guard_s"]) for r in runs["repeats"]),
        key=lambda r: r["overhead_s"],
    )
    worst = reused[-1]["overhead_s"]
    named = [
        ("fresh: worker start + 1st trial", fresh),
        (f"reused: median of {len(reused)}", reused[len(reused) // 2]),
        (f"reused: worst of {len(reused)}", reused[-1]),
    ]
    for name, trials in studies.items():  # for scale: the tuning trials of part 1
        trials = sorted(trials, key=lambda r: r["overhead_s"])
        if trials:
            named += [
                (f"tuning {name}: median of {len(trials)}", trials[len(trials) // 2]),
                (f"tuning {name}: worst of {len(trials)}", trials[-1]),
            ]
    keys = ("wall_s", "timed_s", "overhead_s", "start_s", "warmup_s", "guard_s", "rest_s")
    verdict = f"{'PASS' if worst <= OVERHEAD_TARGET_S else 'MISS'} (target <= {OVERHEAD_TARGET_S:g} s)"
    text = table(
        f"Per-trial overhead outside the timed windows, seconds: reused worker {verdict}",
        "trial|wall|timed|overhead|of which: worker start|warm-up|guard|build, size, pipes",
        [[name, *(f"{r[k]:.2f}" for k in keys)] for name, r in named],
    )
    result = {"fresh": fresh, "reused": reused, "worst_reused_s": worst, "target_s": OVERHEAD_TARGET_S}
    return result | {"pass": worst <= OVERHEAD_TARGET_S, "tuning": studies}, text


def pass_rate(run: Any, n: int, seconds: float) -> float:
    """Samples/s of ``run()`` (one pass over ``n`` samples), repeated for at least ``seconds``."""
    done, start = 0, time.perf_counter()
    while True:
        run()
        done += n
        if time.perf_counter() - start >= seconds:
            return done / (time.perf_counter() - start)


def rotating_rounds(pipelines: dict[str, Any], n: int, rounds: int, seconds: float) -> dict[str, list[float]]:
    """Each pipeline (a pass over ``n`` samples) warmed once, then ``rounds`` rounds of all of them
    in rotating order, each timed for at least ``seconds``: samples/s per pipeline, per round."""
    for go in pipelines.values():  # a compiled pipeline builds here, outside the rounds
        go()
    names, rates = list(pipelines), {k: [] for k in pipelines}
    for i in range(rounds):
        k = i % len(names)
        for key in names[k:] + names[:k]:
            rates[key].append(pass_rate(pipelines[key], n, seconds))
    return rates


def ratios_to(rates: dict[str, list[float]], reference: str) -> dict[str, float]:
    """Each pipeline's geometric mean over rounds of its rate over ``reference``'s in that round."""
    return {
        k: math.exp(statistics.fmean(math.log(r / p) for r, p in zip(v, rates[reference], strict=True)))
        for k, v in rates.items()
    }
