"""``apply`` and ``dataloader``: a configuration reproduced in the user's own code."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import Config
from .errors import ConfigError

__all__ = ["apply", "dataloader"]


def _read_config(config: Any) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "best_config.json"
        if not path.is_file():
            raise ConfigError(f"No config at {str(path)!r}: give a dict, a best_config.json or its directory.")
        return Config.from_json(path.read_text())
    if isinstance(config, Mapping):
        return Config(config)
    raise ConfigError(
        f"`config` must be a dict, a Config or a path to best_config.json, but got {type(config).__name__}."
    )


def apply(
    model: Any,
    config: Any,
    *,
    device: str = "auto",
    dataset: Any = None,
    loss_fn: Any = None,
    train_dataset: Any = None,
    prune_ignore: tuple[str, ...] = (),
) -> Any:
    """Return ``model`` tuned as ``config`` says (a copy; the original is untouched).

    The returned module takes the same inputs and returns float32 outputs. Process-wide
    settings in the config (``num_threads``, ``cudnn_benchmark``, ``tf32``) are applied to this
    process. Configs that prune or quantize need ``dataset`` (example inputs to trace, batches to
    calibrate; fine-tuning trains with ``loss_fn`` on ``train_dataset``, default ``dataset``), as
    during the search. Give the same data as to :func:`~autotune.optimize` to get the same model.

    Example:
        >>> import torch
        >>> fast = apply(torch.nn.Linear(4, 2), {"amp_dtype": "bfloat16"}, device="cpu")
        >>> fast(torch.randn(3, 4)).dtype
        torch.float32
    """
    import torch

    from ._optimize import _check_model
    from .build import BuildExtras, apply_settings, build
    from .env import resolve_device

    _check_model(model)
    if not isinstance(model, torch.nn.Module):
        model = model()
    cfg = _read_config(config)
    extras = None
    if dataset is not None:
        from torch.utils.data import default_collate

        size = cfg["batch_size"]
        n = len(dataset)
        extras = BuildExtras(
            example=default_collate([dataset[i] for i in range(min(8, n))]),
            calibration=[
                default_collate([dataset[i] for i in range(k, min(k + size, n))])
                for k in range(0, min(8 * size, n), size)
            ],
            loss_fn=loss_fn,
            train_dataset=train_dataset if train_dataset is not None else dataset,
            batch_size=size,
            prune_ignore=tuple(prune_ignore),
        )
    state = build(model, cfg, resolve_device(device), extras=extras)
    apply_settings(state.settings)
    return state.model


def dataloader(dataset: Any, config: Any, **overrides: Any) -> Any:
    """A DataLoader with the tuned batch size and loader settings.

    Args:
        dataset: The dataset.
        config: A dict, :class:`Config`, ``best_config.json`` or its directory.
        **overrides: Any other DataLoader argument (``shuffle=True`` for training, say).

    Example:
        >>> import torch
        >>> loader = dataloader([torch.zeros(3)] * 10, {"batch_size": 4})
        >>> [b.shape[0] for b in loader]
        [4, 4, 2]
    """
    import torch

    from .build import BuildState

    cfg = _read_config(config)
    state = BuildState(model=None, device="cpu")
    from .knobs import REGISTRY, Stage

    for knob in REGISTRY.values():
        if knob.stage == Stage.LOADER:
            knob.apply(state, cfg[knob.name])
    if state.loader_kwargs.get("pin_memory") and not torch.cuda.is_available():
        state.loader_kwargs["pin_memory"] = False
    return torch.utils.data.DataLoader(dataset, **{**state.loader_kwargs, **overrides})
