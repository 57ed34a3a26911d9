"""Datasets: validation of what the user passed (the samples' structure and shapes, a
``collate_fn``'s batches), described once as a :class:`DataInfo`.

What a sample is, and the few operations on samples and batches every stage needs (split into
model inputs and target, move to a device, slice, pad), are in :mod:`autotune.samples`; this
module re-exports them, their former home.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import InputError
from autotune.samples import (  # noqa: F401  (re-exported: their former home, where tests and users import them)
    MASK_KEY,
    MIN_CALIBRATION,
    TARGET_KEYS,
    SequenceInfo,
    as_tensor,
    batch_size_of,
    calibration_draw,
    calibration_split,
    call_model,
    collector_frozen,
    concat_outputs,
    has_tensor,
    image_of,
    is_number_list,
    is_token_sequence,
    map_tensors,
    model_inputs,
    outputs_to_cpu,
    pad_batch,
    sample_inputs,
    sequence_info,
    slice_batch,
    tensor_leaves,
    to_device,
    token_length,
    validation_indices,
)

__all__ = [
    "collector_frozen",
    "TARGET_KEYS",
    "DataInfo",
    "describe",
    "has_tensor",
    "tensor_leaves",
    "map_tensors",
    "model_inputs",
    "to_device",
    "slice_batch",
    "pad_batch",
    "calibration_draw",
    "check_collate",
    "is_number_list",
    "call_model",
    "concat_outputs",
    "outputs_to_cpu",
    "row_sources",
    "SequenceInfo",
    "sample_inputs",
    "sequence_info",
    "token_length",
    "as_tensor",
    "image_of",
]

_N_SHAPE_CHECKS = 16


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """What the tuner needs to know about a dataset.

    Attributes:
        n_samples: ``len(dataset)``.
        kind: ``"tensor"``, ``"tuple"`` or ``"dict"``: the sample's structure.
        shapes: Shape of every leaf of one sample, by its path (``"[0]"``, ``"['ids']"``).
        sample_bytes: Bytes of one sample's tensors.
        image_input: The model input is an image (3-D per sample, 4-D per batch), so
            ``channels_last`` applies.
        sequence: For token sequences (dicts of 1-D integer tensors), their lengths and padding
            (:class:`autotune.batching.SequenceInfo`); ``None`` otherwise. A length that varies
            between samples is ``-1`` in ``shapes``.
        collate: ``"default"`` (``default_collate``), ``"pad"`` (padded to each batch's longest,
            :func:`autotune.batching.pad_collate`), ``"image"`` (images padded to each batch's
            largest, :func:`autotune.shapes.pad_images`) or ``"user"`` (the given ``collate_fn``).
        images_vary: The samples are images (``(C, H, W)`` float inputs) whose height or width
            varies, over the samples looked at.
        in_memory: The dataset is a list or tuple of samples: nothing is decoded on reading them.
        tensor_rows: Every tensor of a sample is a row of a tensor the dataset holds (a
            ``TensorDataset``, or ``__getitem__`` returning ``self.x[i]``), over the samples
            looked at: a batch can be gathered with one index per tensor (see :func:`row_sources`).
    """

    n_samples: int
    kind: str
    shapes: dict[str, tuple[int, ...]]
    sample_bytes: int
    image_input: bool
    sequence: Any = None
    collate: str = "default"
    images_vary: bool = False
    in_memory: bool = False
    tensor_rows: bool = False


def _leaves(obj: Any, path: str = "", strict: bool = True) -> list[tuple[str, Any]]:
    """Every leaf of a sample by its path; a dict's list of numbers is one 1-D leaf. With
    ``strict=False`` (a collate makes the batches) a leaf of any other type is kept as it is."""
    import numpy as np
    import torch

    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [(path or "sample", obj)]
    if isinstance(obj, (bool, numbers.Number)):
        return [(path or "sample", obj)]
    if isinstance(obj, Mapping):
        out = []
        for key, value in obj.items():
            where = f"{path}[{key!r}]"
            out += [(where, value)] if is_number_list(value) else _leaves(value, where, strict)
        return out
    if isinstance(obj, (tuple, list)):
        out = []
        for i, value in enumerate(obj):
            out += _leaves(value, f"{path}[{i}]", strict)
        return out
    if not strict:
        return [(path or "sample", obj)]
    raise InputError(
        f"A sample must be a tensor, a tuple/list (inputs, target) or a dict of tensors or lists of numbers, but "
        f"{path or 'the sample'} is a {type(obj).__name__}. Convert it in the dataset's __getitem__, or pass "
        "collate_fn=... that turns samples into a batch of tensors."
    )


def _shape(value: Any) -> tuple[int, ...]:
    if is_number_list(value):
        return (len(value),)
    return tuple(getattr(value, "shape", ()))


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if is_number_list(value):
        return 8 * len(value)
    return int(getattr(value, "nbytes", 8))


def _check_structure(sample: Any, strict: bool = True) -> str:
    import torch

    if isinstance(sample, torch.Tensor):
        return "tensor"
    if isinstance(sample, Mapping):
        if not sample:
            raise InputError("A dict sample must hold at least one tensor, but sample 0 is an empty dict.")
        return "dict"
    if isinstance(sample, (tuple, list)):
        if len(sample) not in (1, 2) and strict:
            raise InputError(
                f"A tuple sample must be (inputs, target) or (inputs,), but sample 0 has {len(sample)} "
                "items. Group several inputs as ((x1, x2), target)."
            )
        return "tuple"
    _leaves(sample, strict=strict)  # raises with the type's name
    return "other"  # a collate of the user's makes batches of it


def describe(dataset: Any, collate_fn: Any = None, pad_values: Mapping[str, int] | None = None) -> DataInfo:
    """Check that ``dataset`` can be batched and describe it.

    Samples must share one shape, except token sequences of different lengths (tensors, or lists
    of ints as a tokenizer returns them), which an automatic padding collate batches when the
    samples carry an ``attention_mask`` or ``pad_values`` says what pads each sequence. With a
    ``collate_fn``, what it makes of a few samples is checked instead of the samples themselves.

    Raises:
        InputError: the dataset is not map-style, is empty, has samples of an unsupported type
            or of inconsistent shapes that nothing can batch, or ``collate_fn`` fails on them.

    Example:
        >>> import torch
        >>> describe([(torch.zeros(3, 8, 8), 1)] * 4).image_input
        True
        >>> describe([{"input_ids": [101, 7, 102], "attention_mask": [1, 1, 1]}] * 4).collate
        'pad'
    """
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise InputError(
            f"`dataset` must be a map-style torch Dataset or a sequence of samples (with __len__ and "
            f"__getitem__), but got {type(dataset).__name__}. Wrap an iterable dataset in a list."
        )
    try:
        n = len(dataset)
    except Exception as exc:
        raise InputError(f"len(dataset) failed: {type(exc).__name__}: {exc}") from exc
    if n == 0:
        raise InputError("The dataset is empty: it must hold at least one sample to tune on.")

    def get(i: int) -> Any:
        try:
            return dataset[i]
        except Exception as exc:
            raise InputError(f"dataset[{i}] failed: {type(exc).__name__}: {exc}") from exc

    first = get(0)
    strict = collate_fn is None
    kind = _check_structure(first, strict)
    leaves = _leaves(first, strict=strict)
    step = max(1, n // _N_SHAPE_CHECKS)
    indices = [0] + [i for i in sorted(set(range(step, n, step)) | {n - 1}) if i]
    looked = [first] + [get(i) for i in indices[1:]]
    shapes, sequence = _common_shapes(looked, collate_fn, pad_values)
    if collate_fn is not None:
        check_collate(collate_fn, looked)
    image_input = False
    if kind == "tensor":
        image_input = len(_shape(first)) == 3
    elif kind == "tuple":
        inputs = first[0]
        image_input = len(_shape(inputs)) == 3 and _is_float(inputs)
    lists = any(is_number_list(v) for _, v in leaves)
    pad = sequence is not None and (sequence.varying or lists)
    images_vary = _images_vary(looked)
    if images_vary and collate_fn is None:
        collate = "image"
    else:
        collate = "user" if collate_fn is not None else "pad" if pad or lists else "default"
    return DataInfo(
        n_samples=n,
        kind=kind,
        shapes=shapes,
        # The mean over the samples looked at: images of different sizes differ in bytes too.
        sample_bytes=sum(_nbytes(v) for s in looked for _, v in _leaves(s, strict=strict)) // len(looked),
        image_input=image_input,
        sequence=sequence,
        collate=collate,
        images_vary=images_vary,
        in_memory=isinstance(dataset, (list, tuple)),
        tensor_rows=strict and not isinstance(dataset, (list, tuple)) and row_sources(dataset, indices) is not None,
    )


def row_sources(dataset: Any, indices: Sequence[int]) -> list[Any] | None:
    """The tensors ``dataset`` holds whose rows its samples are, one per tensor of a sample (in
    :func:`tensor_leaves` order): sample ``i``'s leaves are the views ``t[i]`` of them, at every
    index of ``indices``. ``None`` when a sample has another leaf (a number, a tensor made in
    ``__getitem__``) or its structure changes. A ``TensorDataset`` answers its ``tensors``.

    Example:
        >>> import torch
        >>> class Rows(torch.utils.data.Dataset):
        ...     def __init__(self): self.x, self.y = torch.zeros(4, 2), torch.arange(4)
        ...     def __len__(self): return 4
        ...     def __getitem__(self, i): return self.x[i], self.y[i]
        >>> [t.shape[0] for t in row_sources(Rows(), range(4))], row_sources([torch.zeros(2)] * 4, range(4))
        ([4, 4], None)
    """
    import torch

    n = len(dataset)
    if type(dataset) is torch.utils.data.TensorDataset:
        tensors = list(dataset.tensors)
        return tensors if tensors and not any(t.requires_grad for t in tensors) else None
    attrs = list(getattr(dataset, "__dict__", {}).values())
    groups = [list(a.values()) if isinstance(a, Mapping) else a for a in attrs if isinstance(a, (tuple, list, Mapping))]
    nested = [v for group in groups if len(group) <= 64 for v in group]  # a few tensors, not a list of samples
    held = [t for t in attrs + nested if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n]
    sources: list[Any] | None = None
    for i in indices if held else ():
        sample = dataset[i]
        leaves = tensor_leaves(sample)
        if (
            not leaves
            or len(leaves) != len(_leaves(sample, strict=False))
            or (sources is not None and len(leaves) != len(sources))
        ):
            return None  # a leaf that is not a tensor, or another structure
        found = [next((t for t in held if _is_row(leaf, t, i)), None) for leaf in leaves]
        if any(t is None for t in found) or any(a is not b for a, b in zip(found, sources or found, strict=True)):
            return None
        sources = found
    return sources


def _is_row(leaf: Any, source: Any, i: int) -> bool:
    """Whether ``leaf`` is the view ``source[i]`` (same memory, shape, strides and dtype)."""
    return (
        leaf.dtype == source.dtype
        and leaf.device == source.device
        and leaf.shape == source.shape[1:]
        and leaf.stride() == source.stride()[1:]
        and leaf.data_ptr() == source.data_ptr() + i * source.stride(0) * source.element_size()
        and not source.requires_grad
    )


def _images_vary(samples: Sequence[Any]) -> bool:
    """Whether ``samples`` are images of one channel count whose height or width varies."""
    images = [image_of(s) for s in samples]
    if any(x is None for x in images) or len({x.shape[0] for x in images}) != 1:
        return False
    return len({tuple(x.shape[1:]) for x in images}) > 1


def check_collate(collate_fn: Any, samples: Sequence[Any]) -> Any:
    """What ``collate_fn`` makes of the first two ``samples``, checked: a batch holding tensors.

    Raises:
        InputError: it raises, or its batch holds no tensor.
    """
    part = list(samples[:2])
    try:
        batch = collate_fn(part)
    except Exception as exc:
        text = " ".join(str(exc).split())[:300]
        raise InputError(
            f"collate_fn failed on the first {len(part)} samples: {type(exc).__name__}: {text}. It must turn a list of samples "
            "into a batch of tensors (a dict, a tuple or a tensor)."
        ) from exc
    if not has_tensor(batch):
        raise InputError(
            f"collate_fn must return a batch of tensors, but on the first {len(part)} samples it returned a "
            f"{type(batch).__name__} without one. Return tensors (a Hugging Face collator: return_tensors='pt')."
        )
    return batch


def _first_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """The first leaf path one sample has and the other lacks, in words."""
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a and (not only_b or only_a[0] <= only_b[0]):
        return f"sample 0 has {only_a[0]}, which sample {{i}} lacks"
    return f"sample {{i}} has {only_b[0]}, which sample 0 lacks"


def _common_shapes(
    samples: list[Any], collate_fn: Any, pad_values: Mapping[str, int] | None
) -> tuple[dict[str, tuple[int, ...]], Any]:
    """The shape of every leaf, ``-1`` where a token sequence's length varies, and the samples'
    :class:`~autotune.batching.SequenceInfo`; :class:`InputError` when nothing can batch them.
    With a ``collate_fn``, samples may differ in anything: it is checked on its own."""
    strict = collate_fn is None
    shapes = {path: _shape(value) for path, value in _leaves(samples[0], strict=strict)}
    varying: set[str] = set()
    for i, sample in enumerate(samples[1:], 1):
        other = {path: _shape(value) for path, value in _leaves(sample, strict=strict)}
        if other.keys() != shapes.keys() and strict:
            raise InputError(
                f"Samples differ in structure: {_first_difference(shapes, other).format(i=i)}. Every sample must "
                "have the same fields: give each sample every field, or pass collate_fn=... to batch them."
            )
        varying |= {path for path, shape in shapes.items() if other.get(path) != shape}
    sequence = sequence_info(samples)
    if not varying:
        return shapes, sequence
    if collate_fn is None and _images_vary(samples) and all(p in ("sample", "[0]") for p in varying):
        # Images of different sizes: autotune's image collate pads each batch to its largest.
        return {p: (shape[0], -1, -1) if p in varying else shape for p, shape in shapes.items()}, sequence
    token_paths = set() if sequence is None else {f"[{k!r}]" for k in (*sequence.keys, MASK_KEY)}
    tokens_only = all(any(p.endswith(t) for t in token_paths) for p in varying)
    if collate_fn is None and not (tokens_only and (sequence.has_mask or pad_values)):
        path = sorted(varying)[0]
        lengths = sorted({_shape(v) for s in samples for p, v in _leaves(s) if p == path})
        hint = (
            "give pad_values={...} (the pad id of each sequence) or collate_fn=..., or add an attention_mask"
            if tokens_only
            else "pad or resize them in the dataset, or pass collate_fn=... to batch them"
        )
        raise InputError(
            f"Samples have inconsistent shapes: {path} has shapes {[list(x) for x in lengths[:4]]}. Every "
            f"sample must have the same shape to be batched: {hint}."
        )
    return {p: (-1, *shape[1:]) if p in varying else shape for p, shape in shapes.items()}, sequence


def _is_float(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return getattr(dtype, "is_floating_point", False) or str(dtype).startswith("float")
