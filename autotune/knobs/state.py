"""What the knobs change while a configuration is built, and the wrappers a built model runs in.

:class:`BuildState` is the one object every knob's ``apply`` receives; :class:`TunedModule`
runs the user's model behind autocast and channels-last inputs; :class:`FrozenCompiled` (a
:class:`~autotune.export.parity.CompiledWith`) runs a compiled module with inductor's weight
freezing on. This module imports no other part of
autotune's phases, so knobs, the trial and the exporters can all depend on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autotune.export.parity import FrozenCompiled
from autotune.samples import collector_frozen, map_tensors, to_device

__all__ = ["BuildExtras", "BuildState", "FrozenCompiled", "TunedDataLoader", "TunedModule", "unwrap", "wrap"]


class TunedModule(torch.nn.Module):
    """The user's model behind autocast and channels-last inputs; outputs stay float32.

    Args:
        model: The (possibly pruned or quantized) model.
        amp_dtype: ``"bfloat16"``, ``"float16"`` or ``None`` for no autocast.
        channels_last: Convert 4-D floating inputs to channels-last memory format.
    """

    def __init__(self, model: torch.nn.Module, amp_dtype: str | None, channels_last: bool) -> None:
        super().__init__()
        self.model = model
        self.amp_dtype = amp_dtype
        self.channels_last = channels_last

    def _prepare(self, value: Any) -> Any:
        if self.channels_last and isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
            return value.contiguous(memory_format=torch.channels_last)
        return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.amp_dtype is None and not self.channels_last:
            # Nothing to change: a call as direct as the user's own, whose small model may take
            # only tens of microseconds (the baseline is timed this way too).
            return self.model(*args, **kwargs)
        args = tuple(self._prepare(a) for a in args)
        kwargs = {k: self._prepare(v) for k, v in kwargs.items()}
        if self.amp_dtype is None:
            return self.model(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device_type = tensors[0].device.type if tensors else "cpu"
        with torch.autocast(device_type, dtype=getattr(torch, self.amp_dtype)):
            out = self.model(*args, **kwargs)
        # Callers get float32, as from the untuned model: a drop-in replacement.
        return _to_float32(out)


class TunedDataLoader(torch.utils.data.DataLoader):
    """The DataLoader :func:`autotune.dataloader` returns: a ``torch.utils.data.DataLoader``
    whose each pass runs with the objects alive before it left out of Python's full garbage
    collections (:func:`autotune.data.collector_frozen`), given back at the pass's end or when
    the loop is left."""

    def __iter__(self) -> Any:
        return _frozen_pass(super().__iter__())


def _frozen_pass(batches: Any) -> Any:
    with collector_frozen():
        yield from batches


def unwrap(model: Any) -> Any:
    """The user's (tuned) module under the compile, freezing and autocast wrappers."""
    model = getattr(model, "_orig_mod", model)
    return model.model if isinstance(model, TunedModule) else model


def _to_float32(out: Any) -> Any:
    return map_tensors(lambda t: t.float() if t.is_floating_point() else t, out)


@dataclasses.dataclass
class BuildExtras:
    """Data some knobs need besides the model: example inputs to trace (pruning, export),
    calibration batches (static quantization), and what recovery fine-tuning trains with.

    Attributes:
        example: One collated batch on the CPU.
        calibration: Collated batches on the CPU.
        loss_fn: ``loss_fn(outputs, batch) -> Tensor`` or ``None``.
        train_dataset: Samples for fine-tuning.
        batch_size: Fine-tuning batch size.
        prune_ignore: Module names pruning keeps whole (the output layer always is).
        seed: Seeds fine-tuning's shuffling.
        keep_float: Keep a copy of the pruned float model (for export fallbacks).
        collate_fn: The base collate of every batch (the user's, the padding collate, or
            ``None`` for ``default_collate``).
        lengths: The real length of every sample of the measured dataset (token sequences), for
            ``length_grouping``.
        int8: How ``int8_fallback`` ranks and judges layers (:class:`autotune.compress.fallback.Int8Plan`).
        token_outputs: The float ``(batch, seq)`` outputs that hold one value per token, found on
            the baseline (:func:`autotune.batching.token_outputs`).
        ragged: Samples per batch of the guard's batches when the baseline's outputs change shape
            from batch to batch (:class:`autotune.shapes.Batches`); 0 when they join.
        images: The samples are images whose size varies; ``lengths`` then holds their sort
            keys (:func:`autotune.shapes.size_keys`), for ``size_grouping``.
        width: The one width every token sequence is stored at (pre-padded text), or ``None``
            where widths differ: batched as given, such samples make batches of one shape.
        macs: MACs per sample counted on ``example``, by the model's class, parameters and
            device after pruning (:func:`autotune.trial.build.build`): every build of one
            structure counts the same, and counting took 0.1 s of each of real MiniLM's builds.
    """

    example: Any = None
    calibration: list[Any] = dataclasses.field(default_factory=list)
    loss_fn: Any = None
    train_dataset: Any = None
    batch_size: int = 32
    prune_ignore: tuple[str, ...] = ()
    seed: int = 0
    keep_float: bool = False
    collate_fn: Any = None
    lengths: list[int] | None = None
    int8: Any = None
    token_outputs: tuple[int, ...] = ()
    ragged: int = 0
    images: bool = False
    width: int | None = None
    macs: dict[tuple[Any, ...], int | None] = dataclasses.field(default_factory=dict)

    def example_on(self, device: str) -> Any:
        """The example batch on ``device``."""
        return to_device(self.example, torch.device(device))


@dataclasses.dataclass
class BuildState:
    """What the knobs change, stage by stage.

    Attributes:
        model: The module being built; after the build, the thing to call.
        device: Where it runs.
        batch_size: Samples per batch.
        amp_dtype: Autocast dtype name or ``None``.
        channels_last: Whether 4-D inputs and weights are channels-last.
        compile_mode: ``torch.compile`` mode or ``"none"``.
        loader_kwargs: Keyword arguments of the DataLoader.
        non_blocking: Copy batches to the device asynchronously (with pinned memory).
        settings: Process-wide settings (``num_threads``, ``cudnn_benchmark``, ``tf32``).
        extras: Example, calibration and fine-tuning data (see :class:`BuildExtras`).
        prune_ratio: Set by the ``prune_ratio`` knob for ``prune_method`` to act on.
        quantization: The quantization method applied.
        info: What the build did: params and MACs before and after pruning, quantization details.
        config: The whole configuration, for knobs whose work depends on others' values.
        runtime: ``torch``, ``torchscript`` or ``onnxruntime``: what runs the model.
        float_model: With ``extras.keep_float``, a copy of the model after pruning and before
            quantization: the nearest form an exporter can take when the tuned one fails.
        torch_model: The torch module a non-torch runtime (TorchScript, ONNX Runtime) replaced.
        artifact: The file a non-torch runtime runs, as measured: ``{"format", "path",
            "input_names", ...}`` (ONNX: ``output_names``, ``ort`` session settings, ``precision``).
        optimizer_impl: Training mode: ``default``, ``foreach`` or ``fused`` optimizer step.
        padding: How batches of token sequences are padded (:data:`autotune.batching.PADDINGS`).
        grouping: Batches of similar lengths from windows of this many batches (0: dataset order).
        image_padding: How images autotune batches are padded (:data:`autotune.shapes.IMAGE_PADDINGS`).
        size_grouping: Batches of images of similar shape from windows of this many batches.
        cache_decoded: Loaders read the dataset through a :class:`~autotune.knobs.cache.CachedDataset`.
        gather: ``"per_sample"`` (``__getitem__`` and ``default_collate``) or ``"batched"``: loaders
            over tensor-backed samples read each batch with one index per tensor
            (:mod:`autotune.knobs.gather`).
        device_prefetch: Loaders yield batches already on a CUDA device, each copied on a side
            stream while the one before it runs (:class:`~autotune.knobs.prefetch.DevicePrefetcher`).
        feed_ahead: Batches a background thread makes ahead of the model (0: none).
        device_resident: Loaders read the samples from a copy on the device
            (:mod:`autotune.knobs.resident`), kept in ``resident`` across this build's loaders.
    """

    model: Any
    device: str
    batch_size: int = 32
    amp_dtype: str | None = None
    channels_last: bool = False
    compile_mode: str = "none"
    loader_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    non_blocking: bool = False
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    extras: BuildExtras | None = None
    prune_ratio: float = 0.0
    quantization: str = "none"
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    config: Any = None  # the Config being built (a mapping of knob name to value)
    runtime: str = "torch"
    float_model: Any = None
    torch_model: Any = None
    artifact: dict[str, Any] | None = None
    optimizer_impl: str = "default"
    padding: str = "as_given"
    grouping: int = 0
    image_padding: str = "largest"
    size_grouping: int = 0
    cache_decoded: bool = False
    cache: Any = None  # the CachedDataset of ``cache_decoded``, kept across this build's loaders
    gather: str = "per_sample"
    gathered: Any = None  # (dataset, its GatheredDataset or None), kept across this build's loaders
    device_prefetch: bool = False
    feed_ahead: int = 0
    jpeg_draft: bool = False
    drafted: Any = None  # (dataset, its DraftedDataset), kept across this build's loaders
    device_decode: bool = False
    device_resident: bool = False
    resident: Any = None  # (dataset, its copy on the device), kept across this build's loaders

    def batching(self, lengths: list[int] | None = None) -> Any:
        """The :class:`~autotune.batching.Batching` of this configuration (lengths default to
        the measured dataset's)."""
        from autotune.batching import Batching

        extras = self.extras
        return Batching(
            batch_size=self.batch_size,
            collate_fn=None if extras is None else extras.collate_fn,
            padding=self.padding,
            grouping=self.grouping or self.size_grouping,
            lengths=lengths if lengths is not None else None if extras is None else extras.lengths,
            tokens=() if extras is None else extras.token_outputs,
            image_multiple=image_multiple(self.image_padding),
        )


def image_multiple(value: str) -> int:
    """The multiple of an ``image_padding`` value: ``"largest_16"`` is 16, ``"largest"`` 1."""
    return int(value.rsplit("_", 1)[1]) if "_" in value else 1


def wrap(source: Any, model: Any = None, *, autocast: bool = True) -> TunedModule:
    """The one way a :class:`TunedModule` is made: around ``model`` (default ``source.model``)
    with ``source``'s autocast dtype and channels-last choice.

    Args:
        source: Anything with ``model``, ``amp_dtype`` and ``channels_last``: a
            :class:`BuildState`, a training setup or another :class:`TunedModule`.
        model: The module to wrap instead of ``source.model``.
        autocast: ``False`` drops autocast (float32 compute), as an ONNX export on the CPU needs.

    Example:
        >>> state = BuildState(model=torch.nn.Linear(2, 2), device="cpu", amp_dtype="bfloat16")
        >>> wrap(state, autocast=False).amp_dtype is None
        True
    """
    inner = source.model if model is None else model
    return TunedModule(inner, source.amp_dtype if autocast else None, source.channels_last)
