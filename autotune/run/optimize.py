"""``optimize``, ``apply`` and ``dataloader``: the Python API's verbs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError, InputError, TrialError

if TYPE_CHECKING:
    from autotune.search.result import Result

__all__ = ["optimize", "plan"]

_DEFAULT_MEASURE = {"n_windows": 5, "window_s": 0.4, "warmup_batches": 3}


def _check_options(
    n_trials: Any,
    timeout: Any,
    max_metric_drop: Any,
    isolation: str,
    trial_timeout: Any,
    n_val: Any,
    baseline_batch_size: Any,
    mode: str,
    metric: Any,
) -> None:
    def positive_int(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"`{name}` must be a positive integer, but got {value!r}.")

    positive_int("n_trials", n_trials)
    positive_int("n_val", n_val)
    positive_int("baseline_batch_size", baseline_batch_size)
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
        raise ConfigError(f"`timeout` must be a positive number of seconds or None, but got {timeout!r}.")
    if trial_timeout is not None and (
        not isinstance(trial_timeout, (int, float)) or isinstance(trial_timeout, bool) or trial_timeout <= 0
    ):
        raise ConfigError(
            f"`trial_timeout` must be a positive number of seconds, or None for the adaptive limit, but got "
            f"{trial_timeout!r}."
        )
    if (
        not isinstance(max_metric_drop, (int, float))
        or isinstance(max_metric_drop, bool)
        or not 0 <= max_metric_drop <= 1
    ):
        raise ConfigError(f"`max_metric_drop` must be in [0, 1], but got {max_metric_drop!r}.")
    if isolation not in ("subprocess", "inprocess"):
        raise ConfigError(f"`isolation` must be 'subprocess' or 'inprocess', but got {isolation!r}.")
    if mode not in ("inference", "train"):
        raise ConfigError(f"`mode` must be 'inference' or 'train', but got {mode!r}.")
    if metric is not None and not callable(metric):
        raise ConfigError(
            f"`metric` must be a function metric(outputs, batch) -> float, but got {type(metric).__name__}."
        )


def _guard_summary(mode: str, metric: Any, max_metric_drop: float, loss_tolerance: float) -> dict[str, Any]:
    if metric is not None:
        return {"metric": "user", "max_metric_drop": max_metric_drop}
    if mode == "train":
        return {"metric": "loss_curve", "loss_tolerance": loss_tolerance}
    return {"metric": "fidelity", "max_metric_drop": max_metric_drop}


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


def _materialize_dataset(dataset: Any) -> Any:
    if callable(dataset) and not hasattr(dataset, "__getitem__"):
        try:
            return dataset()
        except Exception as exc:
            raise InputError(f"The dataset factory raised {type(exc).__name__}: {exc}") from exc
    return dataset


def _export(runner: Any, best: dict[str, Any], out: Path, formats: Sequence[str], env: Any) -> dict[str, Any]:
    """Export the winner in the worker; a failure is recorded per format, never raised."""
    if not formats:
        return {}
    try:
        artifacts = runner.call("export", best["config"], str(out.resolve()), list(formats), n_trials=2)["artifacts"]
    except TrialError as exc:
        return {fmt: {"status": "failed", "error": str(exc)} for fmt in formats}
    config = best["config"]
    ort = config["runtime"] == "onnxruntime"
    for fmt, artifact in artifacts.items():
        artifact["batch_size"] = config["batch_size"]
        if fmt == "onnx":
            artifact["ort"] = {
                "provider": config["ort_provider"]
                if ort
                else "CPUExecutionProvider"
                if not env.is_cuda
                else "CUDAExecutionProvider",
                "graph_optimization": config["ort_graph_optimization"] if ort else "all",
                "intra_op_threads": config["num_threads"] or 0,
            }
    return artifacts


def _check_export(export: Any) -> tuple[str, ...]:
    formats = (export,) if isinstance(export, str) else tuple(export or ())
    formats = tuple(f for f in formats if f != "none")
    for fmt in formats:
        if fmt not in ("onnx", "torchscript"):
            raise ConfigError(f"No export format named {fmt!r}. Known: onnx, torchscript (or none).")
    return formats


def _check_like(info: Any, data: Any, name: str) -> None:
    if info.shapes != data.shapes:
        raise InputError(
            f"`{name}` samples must look like the dataset's: got shapes {info.shapes}, expected {data.shapes}."
        )


def _check_model(model: Any) -> None:
    import torch

    if isinstance(model, torch.nn.Module):
        return
    if not callable(model) or (isinstance(model, type) and not issubclass(model, torch.nn.Module)):
        raise InputError(
            f"`model` must be a torch.nn.Module or a zero-argument function returning one, but got {type(model).__name__}."
        )


def plan(
    model: Any,
    dataset: Any,
    *,
    space: Any = "default",
    fix: Mapping[str, Any] | None = None,
    device: str = "auto",
    baseline_batch_size: int = 32,
    objectives: Sequence[str] | str | None = None,
    loss_fn: Any = None,
    mode: str = "inference",
    effective_batch_size: int | None = None,
    allow_batch_change: bool = False,
) -> tuple[Any, Any, Any]:
    """Check the inputs and resolve the search space without measuring anything.

    In training mode (``mode="train"``) inference-only knobs (compression, runtimes) stay off,
    and batch sizes are micro-batches that divide the effective batch (``effective_batch_size``,
    default ``baseline_batch_size``) unless ``allow_batch_change``, as in :func:`optimize`.

    Returns:
        ``(env, data_info, search_space)``; ``search_space.excluded`` says why each value left
        out was left out, ``search_space.objectives`` what will be optimized.
    """
    from autotune.data import describe
    from autotune.env import Env
    from autotune.knobs import SpaceContext
    from autotune.search.select import check_objectives
    from autotune.search.space import preset_options, resolve_space

    _check_model(model)
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(
            f"`loss_fn` must be a function loss_fn(outputs, batch) -> Tensor, but got {type(loss_fn).__name__}."
        )
    data = describe(_materialize_dataset(dataset))
    env = Env.detect(device)
    declared = preset_options(space)
    objectives = check_objectives(objectives or declared.get("objectives") or ("throughput",))
    ctx = SpaceContext(
        env,
        data,
        baseline_batch_size,
        objectives=tuple(objectives),
        has_loss_fn=loss_fn is not None,
        mode=mode,
        effective_batch_size=None
        if mode != "train" or allow_batch_change
        else (effective_batch_size or baseline_batch_size),
    )
    resolved = resolve_space(space, ctx, fix)
    resolved.objectives = objectives
    resolved.select = declared.get("select")
    return env, data, resolved


def optimize(
    model: Any,
    dataset: Any,
    *,
    mode: str = "inference",
    space: str | Path | Mapping[str, Any] = "default",
    metric: Callable[[Any, Any], float] | None = None,
    max_metric_drop: float = 0.01,
    objectives: Sequence[str] | str | None = None,
    n_trials: int = 30,
    timeout: float | None = None,
    device: str = "auto",
    out_dir: str | Path = "autotune-out",
    storage: str | None = None,
    study_name: str | None = None,
    resume: bool = False,
    join: bool = False,
    devices: Sequence[int | str] | str | None = None,
    heartbeat_interval_s: int = 30,
    grace_period_s: int = 180,
    fix: Mapping[str, Any] | None = None,
    seed: int = 0,
    baseline_batch_size: int = 32,
    trial_timeout: float | None = None,
    isolation: str = "subprocess",
    n_val: int = 512,
    measure: Mapping[str, Any] | None = None,
    n_verify_pairs: int = 5,
    n_finalists: int = 3,
    select: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    train_dataset: Any = None,
    prune_ignore: Sequence[str] = (),
    test_dataset: Any = None,
    export: Sequence[str] | None = None,
    sampler: Any = None,
    optimizer: Any = None,
    effective_batch_size: int | None = None,
    allow_batch_change: bool = False,
    loss_tolerance: float = 0.05,
    n_train_steps: int = 20,
    progress: Callable[[dict[str, Any], int, int], None] | None = None,
    output_kind: Any = "auto",
) -> Result:
    """Search for the fastest configuration of ``model`` on ``dataset`` whose accuracy holds.

    Args:
        model: An ``nn.Module`` or a zero-argument function returning one.
        dataset: A map-style dataset or sequence of samples (or a function returning one).
        mode: ``"inference"`` (tune the forward pass) or ``"train"`` (tune the training step:
            needs ``loss_fn`` and ``optimizer``; see docs/training.md).
        space: Preset name (``autotune spaces`` lists them), a TOML file, or a dict of knob
            values on top of a preset (see :func:`autotune.search.space.resolve_space`).
        metric: ``metric(outputs, batch) -> float``, higher is better; without it, fidelity to
            the baseline's outputs is the metric.
        max_metric_drop: Largest allowed drop of the metric below the baseline's (absolute).
            For fidelity it applies to each output by its kind: see ``output_kind``.
        objectives: What to optimize, any of ``throughput`` (max), ``latency`` (p95, min),
            ``size`` (compressed bytes, min), ``memory`` (peak, min) and ``metric`` (max); default
            the preset's own (``shrink`` declares size and latency), else ``("throughput",)``.
        n_trials: Measured trials in the study (a resumed study counts its earlier ones).
        timeout: Seconds for this call's search; ``None`` for no limit. A trial still running at
            the deadline is stopped; the rounds that confirm the winner then take about a quarter
            of it (20 to 90 s), export and reports follow.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        out_dir: Directory of the result files.
        storage: Optuna storage URL; default ``sqlite:///<out_dir>/study.db``.
        study_name: Default ``"autotune"``.
        resume: Continue an existing study instead of refusing to touch it.
        join: Share the study with other workers (other processes, other machines) that run
            it now or later: created by whichever comes first, joined by the rest; the budget
            ``n_trials`` counts every worker's trials. See docs/scaling.md.
        devices: One worker per listed device of this machine, sharing the study: GPU indices
            (``[0, 1, 2, 3]``, each worker pinned to its GPU) or ``"cpu"`` repeated (parallel CPU
            workers compete for cores: for smoke tests, not for honest CPU timings).
        heartbeat_interval_s: Seconds between heartbeats of a running trial in the storage.
        grace_period_s: Seconds without a heartbeat after which a trial's worker is taken for
            dead: its trial is marked failed and its configuration retried once.
        fix: Knobs pinned to one value, e.g. ``{"amp_dtype": "bfloat16"}``.
        seed: Seeds the sampler and torch.
        baseline_batch_size: Batch size of the baseline (your current one).
        trial_timeout: Seconds one trial may take before its worker is killed; ``None`` (the
            default) adapts it: 10 times the baseline trial's wall time, at least 30 s, plus
            120 s for a configuration that compiles, quantizes, prunes or changes the runtime.
            A trial still running at the ``timeout`` deadline is stopped then.
        isolation: ``"subprocess"`` (a worker process, restarted after faults) or ``"inprocess"``.
        n_val: Samples in the fixed validation subset of the guard.
        measure: Timing settings: ``n_windows``, ``window_s``, ``warmup_batches``, and the noise
            limits ``max_cov`` (0.05), ``max_others_cpu`` (0.10) and ``n_remeasure`` (2); see
            :class:`autotune.trial.measure.MeasureSettings`.
        n_verify_pairs: Interleaved rounds that choose among the finalists, and the least number
            of fresh confirmation rounds of the chosen one against the baseline (they continue,
            up to three times as many, until the speedup's 95% interval is within +-5%).
        n_finalists: Best trials re-measured against the baseline before the winner is chosen:
            one measurement per trial can flatter a configuration by chance.
        select: With several objectives, which member of the feasible Pareto front wins: an
            objective name, or a function of the front's records returning one; default the
            highest throughput.
        loss_fn: ``loss_fn(outputs, batch) -> Tensor``; enables recovery fine-tuning of pruned
            candidates (the ``finetune_steps`` knob).
        train_dataset: Samples for fine-tuning (default: the samples of ``dataset`` outside the
            validation subset, which then holds at most half of them).
        prune_ignore: Module names (as in ``named_modules()``) that pruning keeps whole.
        test_dataset: Held-out samples: the baseline's and the winner's metric on them is
            reported (``held_out`` in ``best_config.json``), never used to choose.
        export: Artifacts of the winner to write, each with its parity check: ``"onnx"``
            (``model.onnx``), ``"torchscript"`` (``model.pt``); ``()`` for none. Default both
            in inference mode, none in training mode.
        sampler: An Optuna sampler to use instead of the seeded TPE sampler.
        progress: Called after each trial with (trial record, trials measured, n_trials).
        optimizer: Training mode: an optimizer class (``torch.optim.AdamW``), a pair
            ``(class, kwargs)`` or a function ``params -> optimizer``; its hyper-parameters are
            never tuned, only its implementation (``optimizer_impl``).
        effective_batch_size: Training mode: samples per optimizer step, kept by gradient
            accumulation over micro-batches (``batch_size``); default ``baseline_batch_size``.
        allow_batch_change: Training mode: let the effective batch size follow ``batch_size``
            (one micro-batch per step); the loss guard still applies.
        loss_tolerance: Training mode without a ``metric``: largest relative change of the final
            mean loss after ``n_train_steps`` steps from the same start, against the baseline's.
        n_train_steps: Training mode: optimizer steps (at the baseline's effective batch) each
            trial trains before timing; their losses are the guard.
        output_kind: How fidelity (no ``metric``) judges the outputs: ``"auto"``, ``"logits"``,
            ``"embedding"`` or ``"integer"`` for every output, a list in output order or a dict
            by output name. ``"auto"`` takes logits only on strong evidence (integer targets,
            a cross-entropy ``loss_fn``). See docs/concepts.md.

    Returns:
        A :class:`Result`.

    Example:
        >>> import torch, autotune
        >>> data = [(torch.randn(16), 0) for _ in range(256)]
        >>> result = autotune.optimize(torch.nn.Linear(16, 4), data, space="quick", n_trials=3,
        ...                            out_dir="/tmp/autotune-doc")  # doctest: +SKIP
    """
    import autotune.report.summary as report
    import autotune.search.select as _select
    from autotune.data import describe, validation_indices
    from autotune.report.html import write_reports_safely
    from autotune.search.parallel import (
        check_devices,
        close_runners,
        run_workers,
        start_runners,
        worker_ids,
        write_hardware_groups,
    )
    from autotune.search.result import baseline_and_best, claim_speedup, write_best, write_pareto
    from autotune.search.storage import check_heartbeat, owner_attrs, redact
    from autotune.search.study import open_study, trial_record
    from autotune.trial.diagnose import diagnose_run
    from autotune.trial.fidelity import check_output_kind
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.train_setup import check_effective, check_training, optimizer_name
    from autotune.trial.worker import WorkerSpec

    _check_options(
        n_trials, timeout, max_metric_drop, isolation, trial_timeout, n_val, baseline_batch_size, mode, metric
    )
    _select.check_select(select)
    check_output_kind(output_kind)
    check_heartbeat(heartbeat_interval_s, grace_period_s)
    out = check_out_dir(out_dir)
    device, devices = check_devices(device, devices, isolation)
    train = mode == "train"
    if train:
        check_training(
            loss_fn,
            optimizer,
            test_dataset,
            export,
            loss_tolerance,
            n_train_steps,
            train_dataset,
            effective_batch_size,
            allow_batch_change,
            baseline_batch_size,
        )
    export = _check_export(export if export is not None else (() if train else ("onnx", "torchscript")))
    try:
        timing = MeasureSettings(**{**_DEFAULT_MEASURE, **dict(measure or {})})
    except TypeError as exc:
        raise ConfigError(
            f"`measure` takes n_windows, window_s, warmup_batches, max_cov, max_others_cpu and n_remeasure: {exc}."
        ) from None
    dataset = _materialize_dataset(dataset)
    train_dataset = _materialize_dataset(train_dataset) if train_dataset is not None else None
    test_dataset = _materialize_dataset(test_dataset) if test_dataset is not None else None
    env, data, search_space = plan(
        model,
        dataset,
        space=space,
        fix=fix,
        device=device,
        baseline_batch_size=baseline_batch_size,
        objectives=objectives,
        loss_fn=loss_fn,
        mode=mode,
        effective_batch_size=effective_batch_size,
        allow_batch_change=allow_batch_change,
    )
    objectives = search_space.objectives
    if train and "size" in objectives:
        raise ConfigError(
            "Training mode does not change the model's size: objectives may be throughput, latency, memory or metric."
        )
    if train and "metric" in objectives and metric is None:
        raise ConfigError(
            "The `metric` objective needs a `metric` function; without one, training mode judges the loss."
        )
    if train:
        effective_batch_size = check_effective(effective_batch_size, allow_batch_change, baseline_batch_size, data)
    select = select or search_space.select
    _select.check_select(select)
    if test_dataset is not None:
        _check_like(describe(test_dataset), data, "test_dataset")
    if train_dataset is not None:
        _check_like(describe(train_dataset), data, "train_dataset")
    storage = storage or f"sqlite:///{out.resolve() / 'study.db'}"
    study_name = study_name or "autotune"
    ids = worker_ids(devices)
    study = open_study(
        storage,
        study_name,
        objectives,
        seed,
        resume,
        sampler,
        hardware=env.hardware_key(),
        env=env.manifest(),
        join=join,
        worker=ids[0],
        heartbeat_interval_s=heartbeat_interval_s,
        grace_period_s=grace_period_s,
    )

    if loss_fn is not None and train_dataset is None and not train:
        # Fine-tuning trains on the samples the guard does not score: at most half are held out.
        n_val = min(n_val, data.n_samples // 2)
    val_indices = validation_indices(data.n_samples, n_val)
    spec = WorkerSpec(
        model=model,
        dataset=dataset,
        metric=metric,
        device=env.device,
        baseline=search_space.baseline,
        val_indices=val_indices,
        measure=timing,
        seed=seed,
        loss_fn=loss_fn,
        train_dataset=train_dataset,
        prune_ignore=tuple(prune_ignore),
        test_dataset=test_dataset,
        max_metric_drop=max_metric_drop,
        mode=mode,
        optimizer=optimizer,
        effective_batch_size=effective_batch_size,
        n_train_steps=n_train_steps,
        loss_tolerance=loss_tolerance,
        output_kind=output_kind,
    )
    from autotune.search.study import FIRST_TRIAL_TIMEOUT_S

    runners = start_runners(spec, devices, isolation, trial_timeout or FIRST_TRIAL_TIMEOUT_S, out / "logs")
    runner = runners[0]  # the first device's worker also verifies and exports

    def after_trial(record: dict[str, Any], n_done: int) -> None:
        report.write_trials_csv(out / "trials.csv", [trial_record(t) for t in study.get_trials(deepcopy=False)])
        if progress is not None:
            progress(record, n_done, n_trials)

    summary = {
        "env": env.manifest(),
        "mode": mode,
        "guard": _guard_summary(mode, metric, max_metric_drop, loss_tolerance),
        "objectives": list(objectives),
        "study": {
            "name": study_name,
            "storage": redact(storage),
            "optuna_study": study.study_name,
            "hardware": env.hardware_key(),
        },
        "space": search_space.values,
    }
    if loss_fn is not None and not train:  # the split between what fine-tunes and what the guard scores
        source = "train_dataset" if train_dataset is not None else "dataset samples outside the validation subset"
        summary["guard"].update(n_val=len(val_indices), finetune_data=source)
    if train:
        summary["train"] = {
            "effective_batch_size": effective_batch_size,
            "allow_batch_change": allow_batch_change,
            "optimizer": optimizer_name(optimizer),
            "n_train_steps": n_train_steps,
        }
    try:
        stop_reason = run_workers(
            study,
            runners,
            search_space,
            ids=ids,
            seed=seed,
            sampler=sampler,
            n_trials=n_trials,
            timeout=timeout,
            max_metric_drop=loss_tolerance if train and metric is None else max_metric_drop,
            objectives=objectives,
            extra_attrs={"hardware": env.hardware_key(), **owner_attrs()},
            on_trial=after_trial,
            trial_timeout=trial_timeout,
        )
        baseline, best = baseline_and_best(study, objectives, select)
        confirmed = None
        records = [trial_record(t) for t in study.get_trials(deepcopy=False)]
        front = write_pareto(out, records, objectives) if len(objectives) > 1 else []
        finalists = _select.finalists(records, objectives, baseline["key"], n_finalists, select)
        if finalists:
            speed_only = list(objectives) == ["throughput"]
            # With a timeout the search ended on time; the rounds after it take a bounded share.
            budget_s = None if timeout is None else max(20.0, min(90.0, timeout / 4))
            best, confirmed, summary["finalists"] = claim_speedup(
                runner, baseline, finalists, n_verify_pairs, speed_only, timing, diagnose=not train, budget_s=budget_s
            )
        # Why it won: the loader and the model timed apart, in the confirmation rounds.
        summary["diagnosis"] = diagnose_run(runner, baseline, best, confirmed) if not train else None
        if test_dataset is not None:
            try:
                summary["held_out"] = runner.call("held_out", baseline["config"], best["config"], n_trials=2)
            except TrialError as exc:  # the search's result stands without it
                summary["held_out"] = {"error": str(exc)}
        summary["artifacts"] = _export(runner, best, out, export, env)
    except KeyboardInterrupt:
        # Keep what was found so far; the ratio then comes from the two trials, unverified.
        picked = baseline_and_best(study, objectives, select, required=False)
        if picked is not None:
            write_best(out, summary, *picked, confirmed=None, stop_reason="interrupted", study=study, interrupted=True)
        raise
    finally:
        close_runners(runners)
        report.write_trials_csv(out / "trials.csv", [trial_record(t) for t in study.get_trials(deepcopy=False)])
    result = write_best(out, summary, baseline, best, confirmed=confirmed, stop_reason=stop_reason, study=study)
    result.pareto = front
    write_hardware_groups(out, study, summary, objectives, select)  # by_hardware/ of a mixed study
    write_reports_safely(out, study)  # report.html and report.md; a failure there only warns
    return result
