"""``plan``: the inputs checked and the search space resolved, with nothing measured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import ConfigError, InputError

__all__ = ["materialize", "plan"]


def materialize(dataset: Any) -> Any:
    """The dataset, or what its zero-argument factory returns."""
    if callable(dataset) and not hasattr(dataset, "__getitem__"):
        try:
            return dataset()
        except Exception as exc:
            raise InputError(f"The dataset factory raised {type(exc).__name__}: {exc}") from exc
    return dataset


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
    data = describe(materialize(dataset))
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
