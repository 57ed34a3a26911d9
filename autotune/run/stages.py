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

from autotune.errors import ConfigError, InputError
from autotune.run.finish import finalize, finish_reserve, overrun_margin
from autotune.run.options import Options

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
        from autotune.search.record import trial_record

        return [trial_record(t) for t in self.study.get_trials(deepcopy=False)]

    def write_trials(self) -> None:
        from autotune.report.summary import write_trials_csv

        write_trials_csv(self.out / "trials.csv", self.records())


def check_out_dir(out_dir: Any) -> Path:
    """The output directory, created; :class:`ConfigError` when it is a file or cannot be written."""
    import os

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"The output directory {str(out)!r} is a file; give --out (out_dir) a directory path.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"Cannot create the output directory {str(out)!r} ({exc.strerror or exc}); give --out (out_dir) a "
            "directory you can write to."
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(
            f"The output directory {str(out)!r} is not writable; give --out (out_dir) a directory you can write to."
        )
    return out


def _check_like(info: Any, data: Any, name: str) -> None:
    if info.shapes != data.shapes:
        raise InputError(
            f"`{name}` samples must look like the dataset's: got shapes {info.shapes}, expected {data.shapes}."
        )


def _check_space(opts: Options, space: Any, data: Any) -> Options:
    """Checks that need the resolved space and the data; the options with what they settle."""
    from autotune.data import describe
    from autotune.search.select import check_select
    from autotune.trial.train_setup import check_effective

    if opts.train and "size" in space.objectives:
        raise ConfigError(
            "Training mode does not change the model's size: objectives may be throughput, latency, memory or metric."
        )
    if opts.train and "metric" in space.objectives and opts.metric is None:
        raise ConfigError(
            "The `metric` objective needs a `metric` function; without one, training mode judges the loss."
        )
    check_select(opts.select or space.select)
    for name in ("test_dataset", "train_dataset"):
        if getattr(opts, name) is not None:
            _check_like(describe(getattr(opts, name), opts.collate_fn, opts.pad_values), data, name)
    if not opts.train:
        return opts
    effective = check_effective(opts.effective_batch_size, opts.allow_batch_change, opts.baseline_batch_size, data)
    return opts.replace(effective_batch_size=effective)


def worker_spec(model: Any, dataset: Any, opts: Options, env: Any, space: Any, data: Any, timing: Any) -> Any:
    """The spec every trial worker of a run gets: the model, the samples and how they batch
    (token sequences, images of many sizes, the base collate), the validation split, the guard
    and the timing. Benchmarks start their workers with it too, so their trials are the tuner's."""
    from autotune.samples import calibration_split, validation_indices
    from autotune.trial.spec import WorkerSpec

    n_val = opts.n_val
    if opts.loss_fn is not None and opts.train_dataset is None and not opts.train:
        # Fine-tuning trains on the samples the guard does not score: at most half are held out.
        n_val = min(n_val, data.n_samples // 2)
    n_val = calibration_split(data.n_samples, n_val, opts.train_dataset is not None)[0]
    return WorkerSpec(
        model=model,
        dataset=dataset,
        metric=opts.metric,
        device=env.device,
        baseline=space.baseline,
        val_indices=validation_indices(data.n_samples, n_val),
        measure=timing,
        seed=opts.seed,
        loss_fn=opts.loss_fn,
        train_dataset=opts.train_dataset,
        prune_ignore=tuple(opts.prune_ignore),
        test_dataset=opts.test_dataset,
        max_metric_drop=opts.max_metric_drop,
        mode=opts.mode,
        optimizer=opts.optimizer,
        effective_batch_size=opts.effective_batch_size,
        n_train_steps=opts.n_train_steps,
        loss_tolerance=opts.loss_tolerance,
        output_kind=opts.output_kind,
        collate_fn=_collate(opts, data),
        sequence=data.sequence is not None,
        images=data.images_vary,
    )


def _collate(opts: Options, data: Any) -> Any:
    """The base collate of every batch: the user's, the padding collate for token sequences of
    different lengths, or ``None`` for ``default_collate``."""
    import functools

    from autotune.batching import pad_collate

    if opts.collate_fn is not None:
        return opts.collate_fn
    if data.collate == "pad":
        return functools.partial(pad_collate, pad_values=dict(opts.pad_values or {}))
    if data.collate == "image":
        from autotune.shapes import pad_images

        return pad_images
    return None


def _collate_name(collate: Any) -> str:
    """How autotune batched the samples itself: ``"pad"``, ``"image"`` or ``"default"``."""
    from autotune.shapes import pad_images

    return "default" if collate is None else "image" if collate is pad_images else "pad"


def _stored_rankings(study: Any) -> dict[str, str]:
    """INT8 sensitivity rankings earlier trials of the study computed, by key: a resumed run
    and every worker of a shared study reuse them instead of ranking again."""
    found = {}
    for trial in study.get_trials(deepcopy=False):
        key, ranking = trial.user_attrs.get("int8_ranking_key"), trial.user_attrs.get("int8_ranking")
        if key and ranking:
            found[key] = ranking
    prefix = "int8_ranking:"  # as StudyRankings stores them, the moment each is computed
    found.update({k[len(prefix) :]: v for k, v in study.user_attrs.items() if k.startswith(prefix)})
    return found


def _calibration_source(opts: Options, spec: Any) -> str:
    """Where calibration batches come from, as ``TrialContext`` draws them."""
    from autotune.samples import MIN_CALIBRATION

    if len(spec.dataset) - len(spec.val_indices) >= MIN_CALIBRATION:
        return "dataset samples outside the validation subset"
    return "train_dataset" if opts.train_dataset is not None else "none: int8_static and int8_fallback left out"


def _summary(opts: Options, env: Any, space: Any, study: Any, storage: str, spec: Any) -> dict[str, Any]:
    """The parts of ``best_config.json`` known before the search."""
    from autotune.search.storage import redact
    from autotune.trial.train_setup import optimizer_name

    if opts.metric is not None:
        guard: dict[str, Any] = {"metric": "user", "max_metric_drop": opts.max_metric_drop}
    elif opts.train:
        guard = {"metric": "loss_curve", "loss_tolerance": opts.loss_tolerance}
    else:
        guard = {"metric": "fidelity", "max_metric_drop": opts.max_metric_drop}
    if not opts.train:  # calibration (static int8, int8_fallback's ranking) never sees what the guard scores
        guard.update(n_val=len(spec.val_indices), calibration=_calibration_source(opts, spec))
    if opts.loss_fn is not None and not opts.train:  # the split between what fine-tunes and what the guard scores
        source = "train_dataset" if opts.train_dataset is not None else "dataset samples outside the validation subset"
        guard.update(n_val=len(spec.val_indices), finetune_data=source)
    study_info = {
        "name": opts.study_name or "autotune",
        "storage": redact(storage),
        "optuna_study": study.study_name,
        "hardware": env.hardware_key(),
    }
    summary = {
        "env": env.manifest(),
        "mode": opts.mode,
        "guard": guard,
        "objectives": list(space.objectives),
        "study": study_info,
        "space": space.values,
        # How samples were batched: what the exported predictor's predict() needs to do the same.
        "data": {
            "collate": "user" if opts.collate_fn is not None else _collate_name(spec.collate_fn),
            "pad_values": dict(opts.pad_values or {}),
            "sequence": spec.sequence,
        },
    }
    if not opts.train:  # the draw apply() repeats to rebuild the measured model (data.calibration_draw)
        summary["rebuild"] = {
            "n_samples": len(spec.dataset),
            "n_val": len(spec.val_indices),
            "seed": opts.seed,
            "calibration_batch_size": spec.baseline["batch_size"],
            "n_calibration": spec.n_calibration,
        }
    if opts.train:
        summary["train"] = {
            "effective_batch_size": opts.effective_batch_size,
            "allow_batch_change": opts.allow_batch_change,
            "optimizer": optimizer_name(opts.optimizer),
            "n_train_steps": opts.n_train_steps,
        }
    return summary


def prepare(model: Any, dataset: Any, opts: Options, deadline: float | None = None) -> Run:
    """Check everything, resolve the space, open the study and start the workers (within what
    is left until ``deadline``, a ``time.monotonic()`` instant)."""
    import time

    from autotune.run.plan import materialize, plan, unpack
    from autotune.search.limits import FIRST_TRIAL_TIMEOUT_S
    from autotune.search.parallel import check_devices, start_runners, worker_ids
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
    runners = start_runners(spec, devices, opts.isolation, limit, out / "logs", out / "compile-cache")
    for runner in runners:
        runner.deadline = deadline
    return Run(opts, out, env, space, study, runners, ids, timing, summary, deadline=deadline)


def search(run: Run) -> None:
    """Run the trials; every finished one is in the study and in trials.csv as it ends."""
    from autotune.search.parallel import run_workers
    from autotune.search.storage import owner_attrs

    opts = run.options
    if hasattr(opts.progress, "begin"):  # a display: what a resumed or joined study holds
        opts.progress.begin(run.study, opts.n_trials, resume=opts.resume)

    def after_trial(record: dict[str, Any], n_done: int) -> None:
        run.write_trials()
        if opts.progress is not None:
            opts.progress(record, n_done, opts.n_trials)

    run.stop_reason = run_workers(
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
    """Write the run's files and return its :class:`~autotune.search.result.Result`.

    An interrupted run writes what it has: the best trial so far against the baseline,
    unconfirmed; with no finished baseline there is nothing to write and it returns ``None``.
    """
    from autotune.report.html import write_reports_safely
    from autotune.search.output import write_best
    from autotune.search.parallel import write_hardware_groups
    from autotune.search.result import baseline_and_best

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

    from autotune.search.parallel import close_runners

    started = time.monotonic() if started is None else started
    deadline = None if opts.limit_s is None else started + opts.limit_s
    run = prepare(model, dataset, opts, deadline)
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
