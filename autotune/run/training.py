"""``autotune.training``: the tuned pieces of a training loop for the user's own loop, on one
process or as one rank of a torchrun launch."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError, TrialError
from autotune.run.apply import _read_config, _saved

__all__ = ["training"]


def _unused_from(config: Any) -> bool:
    """``find_unused_parameters`` as the run detected it (``best_config.json``'s ``launch``)."""
    saved = _saved(config) if isinstance(config, (str, Path)) else config
    launch = saved.get("launch") if isinstance(saved, Mapping) else None
    return bool(launch.get("find_unused_parameters")) if isinstance(launch, Mapping) else False


def _effective_from(config: Any) -> int | None:
    """The effective batch size recorded in a training run's ``best_config.json`` (its path or
    its whole dict), if any."""
    saved = _saved(config) if isinstance(config, (str, Path)) else config
    train = saved.get("train") if isinstance(saved, Mapping) else None
    return train.get("effective_batch_size") if isinstance(train, Mapping) else None


def training(
    model: Any,
    optimizer: Any,
    dataset: Any,
    config: Any,
    *,
    device: str = "auto",
    effective_batch_size: int | None = None,
    shuffle: bool = True,
) -> Any:
    """The tuned pieces of a training loop, for your own loop: model, optimizer, gradient
    scaler, autocast context, DataLoader and gradient-accumulation steps.

    Args:
        model: The model to train (it is copied: the original stays untouched).
        optimizer: As for :func:`~autotune.optimize`: a class, ``(class, kwargs)`` or a
            function ``params -> optimizer``.
        dataset: The training samples.
        config: A training run's ``best_config.json`` (or its directory), a dict or a Config.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        effective_batch_size: Samples per optimizer step; default what the run recorded, else
            the config's ``batch_size`` (no accumulation).
        shuffle: Shuffle the loader (it drops the last short batch, so shapes stay fixed).

    Returns:
        A :class:`~autotune.trial.train_setup.TrainingSetup` with ``model``, ``optimizer``, ``scaler``,
        ``autocast()``, ``loader``, ``accumulation_steps``, ``to_device()`` and ``step()``.
        Process-wide settings of the config (threads, cuDNN, TF32) are applied to this process.

    Example:
        >>> import torch
        >>> data = [(torch.randn(8), torch.tensor(i % 2)) for i in range(64)]
        >>> t = training(torch.nn.Linear(8, 2), (torch.optim.SGD, {"lr": 0.1}), data,
        ...              dict(batch_size=8), device="cpu", effective_batch_size=16)
        >>> t.accumulation_steps, len(t.loader)
        (2, 8)
    """
    import torch

    from autotune.env import resolve_device
    from autotune.run.plan import _check_model
    from autotune.trial.build import apply_settings
    from autotune.trial.train_setup import optimizer_factory, prepare

    _check_model(model)
    if not isinstance(model, torch.nn.Module):
        model = model()
    cfg = _read_config(config)
    if effective_batch_size is None:
        effective_batch_size = _effective_from(config)
    device, sampler = resolve_device(device), None
    if cfg.world_size > 1:  # one rank of a torchrun launch: its device, its share of each batch
        from autotune.trial.ddp_steps import distribute, join

        device, sampler, effective_batch_size = join(cfg, device, dataset, shuffle, effective_batch_size)
    try:
        setup = prepare(model, cfg, device, optimizer_factory(optimizer), dataset,
                        effective_batch_size=effective_batch_size, shuffle=shuffle, sampler=sampler)  # fmt: skip
        if sampler is not None:
            distribute(setup, cfg, _unused_from(config))
            setup.sampler = sampler
    except TrialError as exc:  # a config that cannot run here is the caller's input, not a trial's fault
        raise ConfigError(f"This config cannot train here: {exc}.") from None
    inner = getattr(setup.loader, "loader", setup.loader)  # a DevicePrefetcher's DataLoader
    if inner.pin_memory and not torch.cuda.is_available():
        inner.pin_memory = False
    apply_settings(setup.settings)
    return setup
