"""The pieces of the prepare stage (:func:`autotune.run.stages.prepare`): the checks of the
output directory and of the options against the resolved space and the data, the spec every
trial worker gets, and the run's summary that its files start from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.config import values_of
from autotune.errors import ConfigError, InputError
from autotune.run.options import Options

__all__ = ["check_out_dir", "worker_spec"]


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
        sizes="size" in space.objectives or len(space.objectives) > 1,
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
            "calibration_batch_size": values_of(spec.baseline).batch_size,
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
