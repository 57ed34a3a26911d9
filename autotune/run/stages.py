"""One run of :func:`autotune.optimize`, as four stages over a :class:`Run`.

With a ``timeout`` the whole run has one deadline, counted from the call: the search ends
:func:`finish_reserve` seconds before it (the predicted cost of confirming and exporting the
fastest trial so far, from the measured worker start, builds and timings; a trial whose predicted
cost does not fit in what is left is not started), the selection, confirmation and held-out scoring end at it, and
the export ends within :func:`overrun_margin` after it. Every wait on the worker (a trial, a
round, a restart) is bounded by what is left.

- :func:`prepare`: check the inputs, resolve the search space, open the study, start the workers.
- :func:`search`: the trials, until ``n_trials`` or ``timeout``.
- :func:`finalize`: pick among the finalists, confirm the claim on fresh rounds, diagnose,
  score the held-out set, export the winner.
- :func:`write`: ``best_config.json``, ``trials.csv``, the Pareto front and the reports. An
  interrupted run (Ctrl-C) goes through the same stage with what it has.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from autotune.run.finish import finalize, finish_reserve, overrun_margin
from autotune.run.options import Options
from autotune.run.prepare import _check_space, _stored_rankings, _summary, check_out_dir, worker_spec

__all__ = [
    "Run",
    "execute",
    "finalize",
    "finish_reserve",
    "overrun_margin",
    "prepare",
    "search",
    "worker_spec",
    "write",
]


@dataclasses.dataclass
class Run:
    """What the stages pass on: the options, what :func:`prepare` set up and what the later
    stages found. ``summary`` is the body of ``best_config.json`` as it grows."""

    options: Options
    out: Path
    env: Any
    space: Any
    study: Any
    runners: list[Any]
    ids: list[str]
    timing: Any
    summary: dict[str, Any]
    stop_reason: str | None = None
    deadline: float | None = None  # time.monotonic() at which the run's timeout ends
    baseline: dict[str, Any] | None = None
    best: dict[str, Any] | None = None
    confirmed: Any = None
    front: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    history: tuple[Path, str | None] | None = None  # the machine's cache and the model's key there

    def left_s(self) -> float | None:
        """Seconds until the run's deadline (0 once past it), ``None`` without a timeout."""
        import time

        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    @property
    def objectives(self) -> list[str]:
        return list(self.space.objectives)

    @property
    def select(self) -> Any:
        return self.options.select or self.space.select

    def records(self) -> list[dict[str, Any]]:
        from autotune.record import trial_record

        return [trial_record(t) for t in self.study.get_trials(deepcopy=False)]

    def write_trials(self) -> None:
        from autotune.report.summary import write_trials_csv

        write_trials_csv(self.out / "trials.csv", self.records())


def prepare(model: Any, dataset: Any, opts: Options, deadline: float | None = None) -> Run:
    """Check everything, resolve the space, open the study and start the workers (within what
    is left until ``deadline``, a ``time.monotonic()`` instant)."""
    import time

    from autotune.run.plan import materialize, plan, unpack
    from autotune.search.history import PAST_ATTR, history_key, read_history
    from autotune.search.limits import FIRST_TRIAL_TIMEOUT_S
    from autotune.search.parallel import check_devices, machine_cache_dir, start_runners, worker_ids
    from autotune.search.study import open_study

    out = check_out_dir(opts.out_dir)
    device, devices = check_devices(opts.device, opts.devices, opts.isolation)
    opts = opts.replace(
        device=device,
        devices=devices,
        train_dataset=None if opts.train_dataset is None else materialize(opts.train_dataset),
        test_dataset=None if opts.test_dataset is None else materialize(opts.test_dataset),
    )
    dataset = materialize(dataset)
    inputs = unpack(dataset, opts.collate_fn, opts.baseline_batch_size)
    opts = opts.replace(baseline_batch_size=inputs.batch_size, collate_fn=inputs.collate_fn)
    env, data, space = plan(model, dataset, **opts.plan_args())  # a DataLoader gives its settings
    opts = _check_space(opts, space, data)
    storage = opts.storage or f"sqlite:///{out.resolve() / 'study.db'}"
    ids = worker_ids(devices)
    study = open_study(
        storage,
        opts.study_name or "autotune",
        space.objectives,
        opts.seed,
        opts.resume,
        opts.sampler,
        hardware=env.hardware_key(),
        env=env.manifest(),
        join=opts.join,
        worker=ids[0],
        heartbeat_interval_s=opts.heartbeat_interval_s,
        grace_period_s=opts.grace_period_s,
    )
    timing = opts.timing()
    spec = worker_spec(model, inputs.dataset, opts, env, space, data, timing)
    spec.int8_rankings = _stored_rankings(study)
    if isinstance(storage, str):  # each ranking stored as soon as computed, read before ranking again
        from autotune.compress.fallback import StudyRankings

        spec.int8_store = StudyRankings(storage, study.study_name)
    summary = _summary(opts, env, space, study, storage, spec)
    limit = opts.trial_timeout or FIRST_TRIAL_TIMEOUT_S
    if deadline is not None:  # a worker (re)start never waits past the run's deadline
        limit = max(1.0, min(limit, deadline - time.monotonic()))
    cache = machine_cache_dir(out)
    runners = start_runners(spec, devices, opts.isolation, limit, out / "logs", cache)
    # The model as the first worker built it (a factory's too): what the runs before measured of it here.
    n_samples = len(dataset) if hasattr(dataset, "__len__") else None
    history = (cache, history_key((runners[0].info or {}).get("model_digest"), n_samples, env.hardware_key()))
    # The pricing of this model's builds that the runs before measured on this machine (set even
    # when empty: a resumed study must not keep an older run's figures for a cache since emptied).
    study.set_user_attr(PAST_ATTR, read_history(*history))
    for runner in runners:
        runner.deadline = deadline
        runner.on_phase = getattr(opts.progress, "phase", None)  # what the running trial does, for the display
    return Run(opts, out, env, space, study, runners, ids, timing, summary, deadline=deadline, history=history)


def search(run: Run) -> None:
    """Run the trials; every finished one is in the study and in trials.csv as it ends."""
    opts = run.options
    if hasattr(opts.progress, "begin"):  # a display: what a resumed or joined study holds
        opts.progress.begin(run.study, opts.n_trials, resume=opts.resume)

    def after_trial(record: dict[str, Any], n_done: int) -> None:
        run.write_trials()
        if opts.progress is not None:
            opts.progress(record, n_done, opts.n_trials)

    try:
        run.stop_reason = _search(run, opts, after_trial)
    finally:
        _keep_history(run)
    if run.stop_reason == "timeout" and opts.budget is not None and opts.budget == opts.limit_s:
        run.stop_reason = "budget"  # the planned end, not a hard stop
    if hasattr(opts.progress, "search_done"):
        opts.progress.search_done(run.stop_reason)


def _search(run: Run, opts: Options, after_trial: Any) -> str:
    """The trials, in the run's workers; why they stopped."""
    from autotune.search.parallel import run_workers
    from autotune.search.storage import owner_attrs

    return run_workers(
        run.study,
        run.runners,
        run.space,
        ids=run.ids,
        seed=opts.seed,
        sampler=opts.sampler,
        n_trials=opts.n_trials,
        timeout=run.left_s(),
        reserve=None if run.deadline is None else lambda records: finish_reserve(run, records),
        max_metric_drop=opts.loss_tolerance if opts.train and opts.metric is None else opts.max_metric_drop,
        objectives=run.objectives,
        extra_attrs={"hardware": run.env.hardware_key(), **owner_attrs()},
        on_trial=after_trial,
        trial_timeout=opts.trial_timeout,
        strategy=_strategy(run),
    )


def _keep_history(run: Run) -> None:
    """Leave what this search measured of the model's builds for the next run of it on the
    machine (:mod:`autotune.search.history`), even after Ctrl-C or a failed trial."""
    from autotune.search.history import past_builds, write_history

    if run.history is None:
        return
    try:
        staged = _strategy(run)
        records = [r for r in run.records() if "status" in r]
        baseline = next((r for r in records if r.get("baseline") and r.get("status") == "ok"), None)
        measured = past_builds(records, baseline, None if staged is None else staged.score)
    except Exception:  # a hint for the next run: never the reason this one fails, nor hiding why it did
        return
    write_history(*run.history, measured)


def _strategy(run: Run) -> Any:
    """The staged strategy of the run, or ``None`` for plain TPE."""
    if run.options.strategy != "staged":
        return None
    from autotune.search.strategy import Staged

    return Staged(run.space, run.objectives, device=run.env.device, cores=run.env.cpu_threads)


def _story(run: Run, best: dict[str, Any]) -> dict[str, Any]:
    """The search's phases, when ``best`` was found and what screening left out."""
    from autotune.search.phases import search_story

    records = run.records()
    staged = _strategy(run)
    left_out = staged.left_out([r for r in records if "status" in r]) if staged is not None else []
    story = search_story(records, run.options.strategy, best.get("number"), left_out)
    if run.stop_reason == "converged":
        story["converged"] = run.study.user_attrs.get("converged")
    if run.summary.get("finish"):
        story["time"] = {**run.summary.get("time", {}), "finish": run.summary["finish"]}
    return story


def write(run: Run, *, interrupted: bool = False) -> Any:
    """Write the run's files and return its :class:`~autotune.record.Result`.

    An interrupted run writes what it has: the best trial so far against the baseline,
    unconfirmed; with no finished baseline there is nothing to write and it returns ``None``.
    """
    from autotune.report.html import write_reports_safely
    from autotune.run.output import write_best, write_hardware_groups
    from autotune.run.rounds import baseline_and_best

    if interrupted:
        picked = baseline_and_best(run.study, run.objectives, run.select, required=False)
        if picked is None:
            return None
        run.summary["search"] = _story(run, picked[1])
        # Keep what was found so far; the ratio then comes from the two trials, unverified.
        return write_best(
            run.out, run.summary, *picked, confirmed=None, stop_reason="interrupted", study=run.study, interrupted=True
        )
    run.summary["search"] = _story(run, run.best)
    result = write_best(
        run.out,
        run.summary,
        run.baseline,
        run.best,
        confirmed=run.confirmed,
        stop_reason=run.stop_reason,
        study=run.study,
    )
    result.pareto = run.front
    write_hardware_groups(run.out, run.study, run.summary, run.objectives, run.select)  # by_hardware/ of a mixed study
    write_reports_safely(run.out, run.study)  # report.html and report.md; a failure there only warns
    return result


def _say_if_too_small(run: Run) -> None:
    """Say, before the first trial, when what is left of a ``budget`` cannot hold a confirmed
    pick: the baseline, the confirmation's two fresh workers and the export each start a worker
    at least, and one start was just timed."""
    import sys

    left, start = run.left_s(), run.runners[0].start_s
    if run.options.budget is None or left is None or start is None:
        return
    need = 4 * start + 10.0  # starts, and a few seconds of timing each
    if left < need:
        print(
            f"autotune: a budget of {run.options.budget:g} s is too small to confirm a pick here: {left:.0f} s are "
            f"left, a worker start took {start:.1f} s and a confirmed pick needs about {need:.0f} s; the run will "
            f"end 'unconfirmed: deadline'. Give it at least {need + run.options.budget - left:.0f} s.",
            file=sys.stderr,
        )


def execute(model: Any, dataset: Any, opts: Options, started: float | None = None) -> Any:
    """The stages in order; Ctrl-C writes what was found and re-raises; the workers always stop.
    A ``timeout`` or ``budget`` counts from ``started`` (a ``time.monotonic()`` instant: the
    call's), or from now."""
    import time

    from autotune.export.hf import as_module
    from autotune.search.parallel import close_runners

    started = time.monotonic() if started is None else started
    model = as_module(model)  # a SentenceTransformer goes in as it is: called as every phase calls a model
    deadline = None if opts.limit_s is None else started + opts.limit_s
    run = prepare(model, dataset, opts, deadline)
    if hasattr(opts.progress, "header"):
        opts.progress.header(run.env, run.space, run.options, run.out)
    _say_if_too_small(run)
    seconds = run.summary["time"] = {"prepare_s": round(time.monotonic() - started, 1)}
    try:
        search(run)
        seconds["search_s"] = round(time.monotonic() - started - seconds["prepare_s"], 1)
        finalize(run)
        seconds["finish_s"] = round(sum(p["seconds"] for p in run.summary.get("finish") or []), 1)
        seconds["total_s"] = round(time.monotonic() - started, 1)
    except KeyboardInterrupt:
        write(run, interrupted=True)
        raise
    finally:
        close_runners(run.runners)
        run.write_trials()
    return write(run)
