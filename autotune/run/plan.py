"""``plan``: the inputs checked and the search space resolved, with nothing measured."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import ConfigError, InputError

__all__ = ["Inputs", "materialize", "plan", "unpack"]


def n_quantizable(model: Any) -> int | None:
    """How many layers of ``model`` carry weights int8 can quantize (nn.Linear, LSTM, GRU and
    convolutions): an upper bound on the layers any int8 method ranks. ``None`` for a factory
    (the model is not built here)."""
    from torch import nn

    if not isinstance(model, nn.Module):
        return None
    types = (nn.Linear, nn.LSTM, nn.GRU, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return sum(isinstance(m, types) for m in model.modules())


def materialize(dataset: Any) -> Any:
    """The dataset, or what its zero-argument factory returns."""
    if callable(dataset) and not hasattr(dataset, "__getitem__"):
        try:
            return dataset()
        except Exception as exc:
            raise InputError(f"The dataset factory raised {type(exc).__name__}: {exc}") from exc
    return dataset


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The data as the run uses it: the dataset, its collate and the baseline's loader settings.

    Attributes:
        dataset: The map-style dataset.
        collate_fn: The user's collate, or ``None``.
        batch_size: The baseline batch size: the one given, else the DataLoader's, else 32.
        loader: The given DataLoader's ``num_workers``, ``pin_memory``, ``prefetch_factor`` and
            ``persistent_workers``: the baseline's loader settings.
    """

    dataset: Any
    collate_fn: Any = None
    batch_size: int = 32
    loader: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def loader_collate(loader: Any) -> Any:
    """The collate of a DataLoader that reads every sample of its dataset (``None`` for the
    default one).

    Raises:
        InputError: its sampler picks which samples it reads.
    """
    import torch
    from torch.utils.data import default_collate

    if not isinstance(loader.sampler, (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler)):
        raise InputError(
            f"The DataLoader's sampler ({type(loader.sampler).__name__}) picks which samples it reads; autotune "
            "tunes on every sample of its dataset. Pass torch.utils.data.Subset(dataset, indices) instead."
        )
    return None if loader.collate_fn is default_collate else loader.collate_fn


def unpack(dataset: Any, collate_fn: Any = None, baseline_batch_size: int | None = None) -> Inputs:
    """The dataset (or a DataLoader, or a factory of either) as :class:`Inputs`.

    A ``torch.utils.data.DataLoader`` is the baseline as the user runs it: its dataset, its
    collate_fn, its batch size and workers. ``collate_fn`` and ``baseline_batch_size``, when
    given, win over the loader's.
    """
    import torch

    dataset = materialize(dataset)
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigError(f"`collate_fn` must be a function collate_fn(samples) -> batch, but got {collate_fn!r}.")
    if not isinstance(dataset, torch.utils.data.DataLoader):
        return Inputs(dataset, collate_fn, baseline_batch_size or 32)
    loader = dataset
    if loader.batch_size is None:
        raise InputError(
            "The DataLoader has batch_size=None (it yields single samples or uses a batch_sampler): give "
            "optimize() its dataset and baseline_batch_size instead."
        )
    own = loader_collate(loader)
    settings = dict(num_workers=loader.num_workers, pin_memory=loader.pin_memory)
    if loader.num_workers:
        settings.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    return Inputs(loader.dataset, collate_fn or own, baseline_batch_size or loader.batch_size, settings)


def _check_model(model: Any) -> None:
    import torch

    if isinstance(model, torch.nn.Module):
        return
    if not callable(model) or (isinstance(model, type) and not issubclass(model, torch.nn.Module)):
        raise InputError(
            f"`model` must be a torch.nn.Module or a zero-argument function returning one, but got {type(model).__name__}."
        )


def _jpeg_rule(dataset: Any) -> str | None:
    """What the samples' first resize needs of their JPEGs (:func:`autotune.knobs.decode.probe`),
    in words, or ``None`` where reduced-scale decoding does not apply."""
    from autotune.knobs.decode import probe

    rule = probe(dataset)
    return None if rule is None else rule.describe()


def _device_decode(dataset: Any, collate_fn: Any) -> tuple[str | None, str | None]:
    """The folder dataset's transform as the device would run it, in words, and why not where
    it cannot (:func:`autotune.knobs.device_decode.plan_for`)."""
    from torch.utils.data import default_collate

    from autotune.knobs.device_decode import plan_for

    if collate_fn not in (None, default_collate):
        return None, "a collate_fn of your own makes the batches"
    found, why = plan_for(dataset)
    return (None, why) if found is None else (found.describe(), None)


def _no_calibration(n_samples: int, n_val: int, loss_fn: Any, train_dataset: Any) -> str | None:
    from autotune.samples import calibration_split

    if loss_fn is not None and train_dataset is None:
        n_val = min(n_val, n_samples // 2)  # fine-tuning holds half out already
    return calibration_split(n_samples, n_val, train_dataset is not None)[1]


def plan(
    model: Any,
    dataset: Any,
    *,
    space: Any = "default",
    fix: Mapping[str, Any] | None = None,
    device: str = "auto",
    baseline_batch_size: int | None = None,
    objectives: Sequence[str] | str | None = None,
    loss_fn: Any = None,
    mode: str = "inference",
    effective_batch_size: int | None = None,
    allow_batch_change: bool = False,
    collate_fn: Any = None,
    pad_values: Mapping[str, int] | None = None,
    n_val: int = 512,
    train_dataset: Any = None,
    repeated_passes: bool = False,
) -> tuple[Any, Any, Any]:
    """Check the inputs and resolve the search space without measuring anything.

    In training mode (``mode="train"``) inference-only knobs (compression, runtimes) stay off,
    and batch sizes are micro-batches that divide the effective batch (``effective_batch_size``,
    default ``baseline_batch_size``) unless ``allow_batch_change``, as in :func:`optimize`.
    ``dataset`` may be a DataLoader (see :func:`unpack`).

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
    inputs = unpack(dataset, collate_fn, baseline_batch_size)
    data = describe(inputs.dataset, inputs.collate_fn, pad_values)
    baseline_batch_size = inputs.batch_size
    env = Env.detect(device)
    declared = preset_options(space)
    objectives = check_objectives(objectives or declared.get("objectives") or ("throughput",))
    decode, decode_why = _device_decode(inputs.dataset, inputs.collate_fn)
    ctx = SpaceContext(
        env,
        data,
        baseline_batch_size,
        objectives=tuple(objectives),
        has_loss_fn=loss_fn is not None,
        mode=mode,
        loader=dict(inputs.loader),
        repeated_passes=repeated_passes or mode == "train",
        no_calibration=_no_calibration(data.n_samples, n_val, loss_fn, train_dataset),
        n_quantizable=n_quantizable(model),
        jpeg=_jpeg_rule(inputs.dataset),
        device_decode=decode,
        device_decode_why=decode_why,
        effective_batch_size=None
        if mode != "train" or allow_batch_change
        else (effective_batch_size or baseline_batch_size),
    )
    resolved = resolve_space(space, ctx, fix)
    resolved.objectives = objectives
    resolved.select = declared.get("select")
    return env, data, resolved
