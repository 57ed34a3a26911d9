"""``profile``: where a pipeline's time goes, as a trace and an operator table; and the
profiling of a run's baseline and winner after its timed rounds.

Both write ``trace-<label>.json.gz`` (a Chrome trace: Perfetto UI, chrome://tracing and
TensorBoard's profiler plugin open it) and a compact summary (:mod:`autotune.trial.opfamily`).
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError, ConfigError, TrialError
from autotune.report.breakdown import OPEN_TRACES

__all__ = ["OPEN_TRACES", "profile", "profile_run"]


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def profile_run(run: Any) -> None:
    """Profile the run's baseline and winner in the first device's worker, each in its own short
    window after the timed rounds; record the summaries in ``run.summary["profile"]``. Never
    raises: a failure warns in one line and the run keeps everything else."""
    if not run.options.profile:
        return
    if run.left_s() == 0.0:
        limit = run.options.limit_s
        run.summary["profile"] = {"error": f"not profiled: the run's time limit ({limit:g} s) was reached"}
        return
    runner, out = run.runners[0], run.out.resolve()
    found: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        found["baseline"] = runner.call("profile", dict(run.baseline["config"]), str(out / "trace-baseline.json.gz"))
        if run.best.get("key") == run.baseline.get("key"):  # the baseline won: one pipeline, two names
            shutil.copyfile(out / "trace-baseline.json.gz", out / "trace-best.json.gz")
            found["best"] = {**found["baseline"], "trace": "trace-best.json.gz"}
            found["same"] = True
        else:
            found["best"] = runner.call("profile", dict(run.best["config"]), str(out / "trace-best.json.gz"))
    except (TrialError, OSError) as exc:
        found["error"] = f"not profiled: {_one_line(exc)}"
        warnings.warn(f"Profiling failed ({found['error']}); the run's results stand.", RuntimeWarning, stacklevel=2)
    found["device"] = run.env.device
    # What profiling cost the run, building both pipelines in the worker included (the windows'
    # own seconds are each summary's profile_s).
    found["wall_s"] = round(time.perf_counter() - started, 3)
    run.summary["profile"] = found


def _check_same_model(saved: Mapping[str, Any], model: Any, mode: str) -> None:
    """A run's ``best_config.json`` records its model's size and mode: another model's config,
    or a training config for inference, is the user's mistake, said before anything runs."""
    n_params = sum(p.numel() for p in model.parameters())
    recorded = (saved.get("baseline") or {}).get("n_params")
    if isinstance(recorded, int) and recorded != n_params:
        raise ConfigError(
            f"This config was tuned for another model ({recorded:,} parameters; this one has {n_params:,}): pass "
            "the best_config.json of a run on this model."
        )
    if saved.get("mode") not in (None, mode):
        raise ConfigError(
            f"This config is from a {saved['mode']!r} run, but mode={mode!r}: pass mode={saved['mode']!r}."
        )


def _saved_record(config: Any) -> dict[str, Any]:
    from autotune.run.apply import _saved

    if isinstance(config, (str, Path)):
        path = Path(config) / "best_config.json" if Path(config).is_dir() else Path(config)
        if not path.is_file():
            raise ConfigError(f"No config at {str(path)!r}: give a best_config.json or the run's directory.")
        return _saved(path)
    return dict(config) if isinstance(config, Mapping) else {}


def profile(
    model: Any,
    dataset: Any,
    config: Any = None,
    *,
    out_dir: str | Path = "autotune-profile",
    label: str | None = None,
    device: str = "auto",
    mode: str = "inference",
    loss_fn: Any = None,
    optimizer: Any = None,
    collate_fn: Any = None,
    pad_values: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Profile ``model`` fed by ``dataset`` as ``config`` tunes them, in a short window (a
    second or two), and write ``trace-<label>.json.gz`` and ``profile-<label>.json`` to ``out_dir``.

    Args:
        model: An ``nn.Module`` or a zero-argument callable returning one, as for
            :func:`~autotune.optimize`.
        dataset: The samples (or a DataLoader over them).
        config: A dict, :class:`~autotune.Config`, ``best_config.json`` or its run's directory;
            ``None`` profiles the baseline (stock PyTorch, batch size 32).
        out_dir: Where the trace and the summary go.
        label: Names the files; default ``best`` with a config, ``baseline`` without.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        mode: ``"train"`` profiles one training step (forward, backward, optimizer step), with
            ``loss_fn`` and ``optimizer`` as for :func:`~autotune.optimize`.
        collate_fn: The collate the run used, if it needed one.
        pad_values: As for :func:`~autotune.optimize`.

    Returns:
        The summary: ``stages`` and ``families`` (``{name: {"ms", "share"}}``), ``operators``
        (the most expensive, by self time), ``trace`` and the window's size.

    Raises:
        ConfigError: ``config`` is missing, from a run on another model, or cannot run here.

    Example:
        >>> import tempfile, torch
        >>> data = [torch.randn(16) for _ in range(128)]
        >>> s = profile(torch.nn.Linear(16, 4), data, dict(batch_size=16), out_dir=tempfile.mkdtemp(), device="cpu")
        >>> s["trace"], s["operators"][0]["family"]
        ('trace-best.json.gz', 'matmul/linear')
    """
    import torch

    from autotune.run.plan import _check_model

    _check_model(model)
    if not isinstance(model, torch.nn.Module):
        model = model()
    if mode not in ("inference", "train"):
        raise ConfigError(f"`mode` must be 'inference' or 'train', but got {mode!r}.")
    saved = _saved_record(config) if config is not None else {}
    _check_same_model(saved, model, mode)
    label = label or ("best" if config is not None else "baseline")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace-{label}.json.gz"
    try:
        if mode == "train":
            summary = _profile_training(model, dataset, config, trace, device, loss_fn, optimizer)
        else:
            summary = _profile_inference(model, dataset, config, trace, device, collate_fn, pad_values)
    except AutotuneError:
        raise
    except Exception as exc:  # a config the model cannot run is the caller's input
        raise ConfigError(f"This config cannot run on this model here: {_one_line(exc)}.") from None
    (out / f"profile-{label}.json").write_text(json.dumps(summary, indent=1))
    return summary


def _profile_inference(
    model: Any, dataset: Any, config: Any, trace: Path, device: str, collate_fn: Any, pad_values: Any
) -> dict[str, Any]:
    from autotune.batching import lengths_and_width
    from autotune.data import describe
    from autotune.env import resolve_device
    from autotune.run.apply import _extras, _read_config, _rebuild_of, _unloaded, base_collate
    from autotune.run.plan import plan
    from autotune.trial.build import build
    from autotune.trial.profile import profile_state

    dataset, collate_fn = _unloaded(dataset, collate_fn)
    where = resolve_device(device)
    if config is None:
        cfg = _read_config(plan(model, dataset, device=where, collate_fn=collate_fn, pad_values=pad_values)[2].baseline)
    else:
        cfg = _read_config(config)
    collate = base_collate(dataset, collate_fn, pad_values)
    extras = _extras(dataset, cfg, _rebuild_of(config), collate)
    extras.collate_fn = collate
    if describe(dataset, collate_fn, pad_values).sequence is not None:
        extras.lengths, extras.width = lengths_and_width(dataset)
    state = build(model, cfg, where, extras=extras)
    return profile_state(state, dataset, trace)


def _profile_training(
    model: Any, dataset: Any, config: Any, trace: Path, device: str, loss_fn: Any, optimizer: Any
) -> dict[str, Any]:
    from autotune.run.training import training
    from autotune.trial.profile import profile_training

    if loss_fn is None or optimizer is None:
        raise ConfigError("mode='train' needs `loss_fn` and `optimizer`, as optimize() does.")
    setup = training(model, optimizer, dataset, config if config is not None else {}, device=device)

    def epochs() -> Any:
        while True:
            yield from setup.loader

    return profile_training(setup, epochs(), loss_fn, trace)
