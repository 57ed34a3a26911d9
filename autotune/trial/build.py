"""Turn (model, Config) into what runs: knobs applied in stage order.

The result is a :class:`BuildState` holding the tuned module (wrapped for autocast and
channels-last inputs, then compiled), the DataLoader keyword arguments and the process-wide
settings to activate while the model runs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from autotune.config import Config
from autotune.errors import TrialError
from autotune.knobs import REGISTRY, Stage
from autotune.knobs.state import BuildExtras, BuildState, wrap
from autotune.samples import batch_size_of, model_inputs

__all__ = ["apply_settings", "build", "make_loader", "settings_active"]


def build(
    model: Any, config: Config, device: str, *, extras: BuildExtras | None = None, copy_model: bool = True
) -> BuildState:
    """Apply every knob of ``config`` to a copy of ``model``, in stage order.

    With ``extras.example``, the model's parameters and MACs after the STRUCTURE stage are
    recorded in ``state.info`` (``n_params``, ``macs``).

    Example:
        >>> import torch
        >>> state = build(torch.nn.Linear(4, 2), Config(batch_size=8), "cpu")
        >>> state.loader_kwargs["batch_size"]
        8
    """
    model = copy.deepcopy(model) if copy_model else model
    model = model.to(device).eval()
    state = BuildState(model=model, device=device, extras=extras, config=config)
    knobs = sorted(REGISTRY.values(), key=lambda k: (k.stage, k.order))
    stage = Stage.STRUCTURE
    for knob in knobs:
        if stage == Stage.STRUCTURE and knob.stage > Stage.STRUCTURE:
            _count_(state)
        if stage < Stage.COMPILE <= knob.stage:
            state.model = wrap(state).eval()
        stage = knob.stage
        knob.apply(state, config[knob.name])
    return state


def _count_(state: BuildState) -> None:
    state.info["n_params"] = sum(p.numel() for p in state.model.parameters())
    if state.extras is not None and state.extras.keep_float:
        state.float_model = copy.deepcopy(state.model)
    extras = state.extras
    if extras is not None and extras.example is not None:
        # One structure's count holds for every build of it (the example is the extras' own).
        key = (type(state.model).__qualname__, state.info["n_params"], str(state.device))
        if key not in extras.macs:
            extras.macs[key] = _macs(state.model, extras.example_on(state.device))
        state.info["macs"] = extras.macs[key]


def _macs(model: Any, example: Any) -> int | None:
    """MACs per sample of ``model`` on ``example``, or ``None`` where they cannot be counted."""
    from autotune.compress.prune import count_macs

    args, kwargs = model_inputs(example)
    try:
        return count_macs(model, args, kwargs)[0] // batch_size_of(example)
    except Exception:  # a counter that cannot trace the model must not fail the trial
        return None


def make_loader(
    dataset: Any, state: BuildState, *, drop_last: bool = False, timing: bool = False, seed: int = 0
) -> Any:
    """The DataLoader a built configuration reads from: its batch size, workers, collate and
    padding, and with ``length_grouping`` batches of similar lengths (each batch's samples in
    the order :meth:`autotune.batching.Batching.plan` gives).

    With ``timing``, token sequences come in the same batches but in an order shuffled by
    ``seed``: batches of different lengths cost different times, and a timed window reads only a
    stretch of them, so in plan order (grouped batches run longest first) a window would see
    the short end of the epoch and overstate the throughput. Each measurement draws its own
    ``seed``, so repeated measurements time different stretches and their spread shows what
    one stretch's choice of batches costs.

    With ``gather="batched"``, samples that are rows of tensors are read a batch at a time
    (:func:`autotune.knobs.gather.gathered`): the same batches, one index per tensor. With
    ``device_prefetch`` (on CUDA) or ``feed_ahead``, the loader comes wrapped in a
    :class:`~autotune.knobs.prefetch.DevicePrefetcher`, with the loader's length and attributes,
    whose batches are made ahead (and on the device already: moving them there again copies
    nothing)."""
    import random

    from autotune.knobs.resident import host_free_kwargs, on_device

    batching = state.batching()
    kwargs = dict(state.loader_kwargs)
    if state.device_decode:
        return _decoded_loader(dataset, state, batching, kwargs, drop_last)
    dataset, collate = _source(dataset, state, batching)
    if on_device(dataset) or state.device_resident:  # read on the device: no workers, nothing to pin
        kwargs = host_free_kwargs(kwargs)
    sequences = batching.lengths is not None and len(batching.lengths) == len(dataset)
    plan = batching.sampler(len(dataset)) if sequences else None
    if timing and sequences:
        plan = batching.plan(len(dataset))
        if drop_last and len(plan) > 1 and len(plan[-1]) < state.batch_size:
            plan = plan[:-1]
        random.Random(seed).shuffle(plan)
    if plan is not None:
        kwargs.pop("batch_size", None)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=plan, collate_fn=collate, **kwargs)
    else:
        loader = torch.utils.data.DataLoader(dataset, shuffle=False, drop_last=drop_last, collate_fn=collate, **kwargs)
    from autotune.knobs.prefetch import fed

    return fed(loader, state, state.device)


def _decoded_loader(dataset: Any, state: BuildState, batching: Any, kwargs: dict[str, Any], drop_last: bool) -> Any:
    """The loader of ``device_decode``: the folder's files read as bytes, batched as a list, and
    decoded and transformed on the device (:mod:`autotune.knobs.device_decode`), then fed as
    any loader is."""
    from torch.utils.data import default_collate

    from autotune.knobs.device_decode import EncodedFolder, device_decoded, encoded_collate
    from autotune.knobs.prefetch import fed

    if batching.collate_fn not in (None, default_collate) or not str(state.device).startswith("cuda"):
        raise TrialError("unsupported", "device_decode: batches made by default_collate, on a CUDA device")
    loader = torch.utils.data.DataLoader(
        EncodedFolder(dataset), shuffle=False, drop_last=drop_last, collate_fn=encoded_collate, **kwargs
    )
    return fed(device_decoded(loader, dataset, str(state.device)), state, state.device)


def read_samples(dataset: Any, indices: Any, state: BuildState) -> list[Any]:
    """``dataset``'s samples at ``indices`` as ``state``'s loader reads them: with ``jpeg_draft``
    their JPEGs decoded at reduced scale; with ``device_decode`` decoded and transformed on the
    device, a batch at a time, then one sample each, on the host (the targets as numbers)."""
    if state.device_decode:
        from autotune.knobs.device_decode import EncodedFolder, device_decoded, encoded_collate

        files = torch.utils.data.DataLoader(
            EncodedFolder(dataset), batch_size=state.batch_size, sampler=list(indices), collate_fn=encoded_collate
        )
        read: list[Any] = []
        for images, targets in device_decoded(files, dataset, str(state.device)):
            targets = targets.cpu().tolist() if isinstance(targets, torch.Tensor) else targets
            read.extend(zip(images.cpu(), targets, strict=True))
        return read
    if state.jpeg_draft:
        from autotune.knobs.decode import drafted_dataset

        dataset = drafted_dataset(dataset)
    return [dataset[i] for i in indices]


def _check_resident(batching: Any) -> None:
    """Raise a trial error where ``device_resident`` cannot make the batches the run's collate makes."""
    from torch.utils.data import default_collate

    if batching.image_multiple != 1 or batching.collate_fn not in (None, default_collate):
        raise TrialError("unsupported", "device_resident: a collate makes the batches, not default_collate")


def _source(dataset: Any, state: BuildState, batching: Any) -> tuple[Any, Any]:
    """What a build's loaders read and the collate that batches it: with ``gather="batched"``,
    the gathered dataset and the batching's finish, where the samples allow it and
    ``default_collate`` is the base collate; else ``dataset`` (through the build's one cache with
    ``cache_decoded``) and the batching's collate. With ``device_resident``, the samples' copy on
    the device (made once per build and dataset) and the batching's finish. With ``jpeg_draft``,
    the samples are read with JPEGs decoded at reduced scale (:mod:`autotune.knobs.decode`)."""
    if state.jpeg_draft:
        if state.drafted is None or state.drafted[0] is not dataset:
            from autotune.knobs.decode import drafted_dataset

            state.drafted = (dataset, drafted_dataset(dataset))
        dataset = state.drafted[1]
    if state.device_resident:
        if state.resident is None or state.resident[0] is not dataset:
            from autotune.knobs.resident import resident

            _check_resident(batching)
            state.resident = (dataset, resident(dataset, state.device))
        return state.resident[1], batching.finish
    if state.gather == "batched":
        if state.gathered is None or state.gathered[0] is not dataset:  # one check (or stack) per build
            from autotune.knobs.gather import gathered_for

            state.gathered = (dataset, gathered_for(dataset, state, batching))
        if state.gathered[1] is not None:
            return state.gathered[1], batching.finish
    if state.cache_decoded:  # one cache for every loader of this build: later epochs read it
        from autotune.knobs.cache import cached

        if state.cache is None or state.cache.dataset is not dataset:
            state.cache = cached(dataset)
        return state.cache, batching.collate
    return dataset, batching.collate


def apply_settings(settings: dict[str, Any]) -> None:
    """Turn on the process-wide settings a configuration chose (``{knob name: value}``, as the
    RUNTIME knobs record them), each by the knob that owns it (:meth:`Knob.activate`)."""
    for name, value in settings.items():
        REGISTRY[name].activate(value)


@contextlib.contextmanager
def settings_active(settings: dict[str, Any]) -> Iterator[None]:
    """Activate process-wide settings for the duration of the block, then restore every
    process-wide setting (see :mod:`autotune._pristine`) as it was before the block."""
    from autotune._pristine import restore, snapshot

    saved = snapshot()
    try:
        apply_settings(settings)
        yield
    finally:
        restore(saved)
