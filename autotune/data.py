"""Datasets and batches: validation of what the user passed, and the few batch operations
every stage needs (split into model inputs and target, move to a device, slice, pad).

A sample is a tensor, a tuple/list ``(inputs, target)`` or ``(inputs,)``, or a dict of
tensors. ``inputs`` may itself be a tensor, a tuple of tensors (passed positionally) or a dict
(passed as keyword arguments). In a dict sample the keys in :data:`TARGET_KEYS` are the target
and every other key is a keyword argument of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from autotune.errors import InputError

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

TARGET_KEYS = frozenset({"label", "labels", "target", "targets", "y"})
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


def is_number_list(value: Any) -> bool:
    """Whether ``value`` is a non-empty list or tuple of plain numbers: what a tokenizer returns
    for one sequence (``tok(text)["input_ids"]``).

    Example:
        >>> is_number_list([101, 7592, 102]), is_number_list([]), is_number_list(["a"])
        (True, False, False)
    """
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(x, numbers.Number) and not isinstance(x, bool) for x in value)
    )


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


def image_of(sample: Any) -> Any:
    """The image of a sample: a float ``(C, H, W)`` tensor alone or as the inputs of
    ``(inputs, target)``; ``None`` otherwise."""
    import torch

    x = sample[0] if isinstance(sample, (tuple, list)) and sample else sample
    if isinstance(x, torch.Tensor) and x.dim() == 3 and x.is_floating_point():
        return x
    return None


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


def model_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Split a collated batch into the model's positional and keyword arguments."""
    import torch

    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), {k: v for k, v in batch.items() if k not in TARGET_KEYS}
    inputs = batch[0]
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def map_tensors(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict, keeping the structure.

    Mappings keep their own type (a Hugging Face ``ModelOutput`` stays one, so ``.logits``
    still works), named tuples too; other model-output objects with ``to_tuple()`` are mapped as
    tuples.
    """
    import copy

    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {k: map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return mapped
        try:  # a copy of the caller's own type, its values replaced (ModelOutput sets attributes too)
            same = copy.copy(obj)
            for key, value in mapped.items():
                same[key] = value
            return same
        except Exception:
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple takes its fields positionally
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if hasattr(obj, "to_tuple"):
        return map_tensors(fn, obj.to_tuple())
    return obj


def tensor_leaves(obj: Any) -> list[Any]:
    """The tensors of a nested tuple/list/dict (or model-output object), in order: mapping
    values, sequence items, a model output's ``to_tuple()``.

    Example:
        >>> import torch
        >>> [t.item() for t in tensor_leaves({"a": (torch.tensor(1), "x"), "b": [torch.tensor(2)]})]
        [1, 2]
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensor_leaves(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in tensor_leaves(v)]
    if hasattr(obj, "to_tuple"):  # model-output dataclasses
        return tensor_leaves(obj.to_tuple())
    return []


def has_tensor(obj: Any) -> bool:
    """Whether a nested tuple/list/dict (or model-output object) holds at least one tensor.

    Example:
        >>> import torch
        >>> has_tensor({"a": (1, torch.zeros(1))}), has_tensor(None), has_tensor([1, "x"])
        (True, False, False)
    """
    return bool(tensor_leaves(obj))


def to_device(batch: Any, device: Any, *, non_blocking: bool = False) -> Any:
    """Move every tensor of ``batch`` to ``device``, keeping the structure."""
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def batch_size_of(batch: Any) -> int:
    """Number of samples in a collated batch."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return batch_size_of(next(iter(batch.values())))
    return batch_size_of(batch[0])


def slice_batch(batch: Any, stop: int, start: int = 0) -> Any:
    """Samples ``start:stop`` of a collated batch (or of a model's outputs)."""
    return map_tensors(lambda t: t[start:stop] if t.dim() > 0 else t, batch)


def pad_batch(batch: Any, size: int) -> Any:
    """Repeat the last sample until the batch holds ``size`` samples.

    A compiled model sees only one batch shape this way, so no recompilation is triggered by a
    short final batch; the padded rows are sliced off the outputs.
    """
    import torch

    def pad(t: Any) -> Any:
        missing = size - t.shape[0] if t.dim() > 0 else 0
        return torch.cat([t, t[-1:].expand(missing, *t.shape[1:])]) if missing > 0 else t

    return map_tensors(pad, batch)


def validation_indices(n_samples: int, n_val: int, seed: int = 0) -> list[int]:
    """A fixed subset of sample indices: the same for every trial of a study."""
    import numpy as np

    if n_samples <= n_val:
        return list(range(n_samples))
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(n_samples, size=n_val, replace=False))


# Samples calibration (static int8, int8_fallback's ranking and auto) needs outside what the
# guard scores: fewer, and calibrating would fit what the guard then judges.
MIN_CALIBRATION = 8


def calibration_split(n_samples: int, n_val: int, has_train_dataset: bool = False) -> tuple[int, str | None]:
    """How many samples the guard validates on, and why calibration has none of its own, if so.

    A dataset no larger than ``n_val`` would leave nothing outside validation: a quarter of it
    (at least :data:`MIN_CALIBRATION` samples) is then held out for calibration. With fewer than
    twice that, validation keeps them all and calibration needs ``train_dataset``.

    Example:
        >>> calibration_split(1000, 512), calibration_split(100, 512)
        ((512, None), (75, None))
    """
    if n_samples - n_val >= MIN_CALIBRATION or has_train_dataset:
        return min(n_val, n_samples), None
    if n_samples >= 2 * MIN_CALIBRATION:
        return min(n_val, n_samples - max(MIN_CALIBRATION, n_samples // 4)), None
    return n_samples, (
        f"calibration needs {MIN_CALIBRATION} samples the guard does not score, but the dataset has {n_samples} "
        f"and validation needs them all; pass at least {2 * MIN_CALIBRATION} samples or train_dataset="
    )


def calibration_draw(
    n_samples: int, n_val: int, seed: int, batch_size: int, n_batches: int = 8, n_train: int | None = None
) -> tuple[list[int], list[list[int]], bool]:
    """The samples a run builds with: the example batch (the first validation samples, two at
    least) and the calibration batches, as indices, drawn (seeded) outside the validation subset.

    With fewer than :data:`MIN_CALIBRATION` samples outside it, calibration draws from
    ``train_dataset`` (``n_train`` samples) where there is one, else from nothing: calibrating
    never fits what the guard scores. The search and :func:`autotune.apply` both draw here, so
    static int8 and ``int8_fallback`` see the same samples in both.

    Returns:
        ``(example indices, calibration batches of indices, whether they index train_dataset)``.

    Example:
        >>> example, batches, from_train = calibration_draw(100, 10, seed=0, batch_size=4, n_batches=2)
        >>> len(example), [len(b) for b in batches], set(example) & {i for b in batches for i in b}, from_train
        (8, [4, 4], set(), False)
    """
    import numpy as np

    val = validation_indices(n_samples, n_val)
    held = set(val)
    pool = [i for i in range(n_samples) if i not in held]
    from_train = len(pool) < MIN_CALIBRATION and n_train is not None
    if from_train:
        pool = list(range(n_train or 0))
    picked = np.random.default_rng(seed + 1).permutation(pool)[: batch_size * n_batches].tolist() if pool else []
    batches = [picked[k : k + batch_size] for k in range(0, len(picked), batch_size)]
    return val[: max(2, min(8, len(val)))], batches, from_train


def call_model(model: Any, batch: Any) -> Any:
    """Run ``model`` on a batch already on its device."""
    args, kwargs = model_inputs(batch)
    return model(*args, **kwargs)


def concat_outputs(chunks: list[Any]) -> Any:
    """Outputs of consecutive batches joined along the batch axis, structure kept."""
    import torch

    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(chunks) if first.dim() > 0 else first
    if isinstance(first, dict):
        return {k: concat_outputs([c[k] for c in chunks]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat_outputs([c[i] for c in chunks]) for i in range(len(first)))
    return first


@contextlib.contextmanager
def collector_frozen() -> Iterator[None]:
    """Python's cyclic garbage collector leaves out every object alive when the block starts
    (``gc.freeze``), and takes them back at its end (``gc.unfreeze``): nothing is leaked.

    A full collection walks every object the process holds. After torch's import and a model
    trained with ``torch.optim`` (which imports the compiler stack) that is about 300,000 objects
    and 135 ms, and the quickstart's tuned loop (batch 1024) set one off about every 1.2 s: 12%
    of its time, which a pass over the samples need not pay. Inside the block a full collection
    walks only what the pass itself made. Where the collector is off, or something froze it
    already, the block leaves it as it is.

    Example:
        >>> import gc
        >>> with collector_frozen():
        ...     gc.get_freeze_count() > 0
        True
        >>> gc.get_freeze_count()
        0
    """
    import gc

    # Inside a block of ours (predict's pass over the tuned loader's) nothing more to do, and no
    # gc.get_freeze_count(), which walks every frozen object.
    if _FROZEN[0] or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        gc.unfreeze()


_FROZEN = [0]  # blocks of collector_frozen() that froze the collector and have not ended


def outputs_to_cpu(out: Any) -> Any:
    """Outputs detached and on the CPU, floating tensors as float32."""
    import torch

    if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device.type == "cpu":
        return out.detach()  # the common case, without the walk over a structure (a small model's batch is ~100 us)
    return map_tensors(lambda t: t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu(), out)


MASK_KEY = "attention_mask"


def sample_inputs(sample: Any) -> Mapping[str, Any] | None:
    """The dict of model inputs of a sample (or batch), or ``None`` when it has none."""
    if isinstance(sample, Mapping):
        return sample
    if isinstance(sample, (tuple, list)) and sample and isinstance(sample[0], Mapping):
        return sample[0]
    return None


def is_token_sequence(value: Any) -> bool:
    """Whether ``value`` is one sequence of tokens: a 1-D integer tensor or numpy array, or a
    list of ints (as a tokenizer returns it without ``return_tensors``)."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value.dim() == 1 and not value.is_floating_point()
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and np.issubdtype(value.dtype, np.integer)
    return is_number_list(value) and all(isinstance(x, numbers.Integral) for x in value)


def as_tensor(value: Any) -> Any:
    """A list of numbers or a numpy array as a tensor; anything else as it is."""
    import numpy as np
    import torch

    if isinstance(value, np.ndarray) or is_number_list(value):
        return torch.as_tensor(np.asarray(value))
    return value


@dataclasses.dataclass(frozen=True)
class SequenceInfo:
    """What a dataset of sequence samples looks like.

    Attributes:
        keys: The input keys holding one token per position (1-D integer tensors or lists of ints).
        has_mask: Whether samples carry an ``attention_mask``.
        varying: Whether samples differ in length (they need a padding collate).
        padded: Whether samples arrive padded (a mask with zeros at the end or start).
        min_len, max_len, mean_len: Real lengths (tokens the mask keeps), over the samples looked at.
    """

    keys: tuple[str, ...]
    has_mask: bool
    varying: bool
    padded: bool
    min_len: int
    max_len: int
    mean_len: float


def token_length(inputs: Mapping[str, Any], keys: Sequence[str] = ()) -> int:
    """Real tokens of one sample: its mask's ones, else the length of its first sequence."""
    mask = inputs.get(MASK_KEY)
    if mask is not None and is_token_sequence(mask):
        return int(sum(mask) if isinstance(mask, (list, tuple)) else mask.sum())
    key = (
        keys[0] if keys else next((k for k, v in inputs.items() if k not in TARGET_KEYS and is_token_sequence(v)), None)
    )
    return 0 if key is None else len(inputs[key])


def sequence_info(samples: Sequence[Any]) -> SequenceInfo | None:
    """Describe ``samples`` as sequences, or ``None`` when they are not dicts of 1-D integer
    tensors (images, feature vectors, tuples of tensors)."""
    first = sample_inputs(samples[0]) if len(samples) else None
    if first is None:
        return None
    keys = tuple(k for k, v in first.items() if k not in TARGET_KEYS and is_token_sequence(v))
    if not keys:
        return None
    lengths, sizes, padded = [], set(), False
    for sample in samples:
        inputs = sample_inputs(sample)
        if inputs is None or any(k not in inputs or not is_token_sequence(inputs[k]) for k in keys):
            return None
        sizes.add(tuple(len(inputs[k]) for k in keys))
        n = token_length(inputs, keys)
        lengths.append(n)
        padded = padded or n < len(inputs[keys[0]])
    return SequenceInfo(
        keys=keys,
        has_mask=MASK_KEY in first,
        varying=len(sizes) > 1,
        padded=padded,
        min_len=min(lengths),
        max_len=max(lengths),
        mean_len=sum(lengths) / len(lengths),
    )
