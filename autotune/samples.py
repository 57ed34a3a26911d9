"""Samples and batches: what a sample is made of, and the few operations every stage needs
(split into model inputs and target, move to a device, slice, pad, join outputs), the token
sequences a sample may hold, and which samples validate and calibrate.

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

__all__ = [
    "MASK_KEY",
    "MIN_CALIBRATION",
    "TARGET_KEYS",
    "SequenceInfo",
    "as_tensor",
    "batch_size_of",
    "calibration_draw",
    "calibration_split",
    "call_model",
    "collector_frozen",
    "concat_outputs",
    "has_tensor",
    "image_of",
    "is_number_list",
    "is_token_sequence",
    "map_tensors",
    "model_inputs",
    "outputs_to_cpu",
    "pad_batch",
    "sample_inputs",
    "sequence_info",
    "slice_batch",
    "stored_width",
    "tensor_leaves",
    "to_device",
    "token_length",
    "validation_indices",
]


TARGET_KEYS = frozenset({"label", "labels", "target", "targets", "y"})


def is_number_list(value: Any) -> bool:
    """Whether ``value`` is a non-empty list or tuple of plain numbers: what a tokenizer returns
    for one sequence (``tok(text)["input_ids"]``).

    Example:
        >>> is_number_list([101, 7592, 102]), is_number_list([]), is_number_list(["a"])
        (True, False, False)
    """
    if not isinstance(value, (list, tuple)) or not value:
        return False
    if all(type(x) is int or type(x) is float for x in value):  # a tokenizer's lists: no ABC checks
        return True
    return all(isinstance(x, numbers.Number) and not isinstance(x, bool) for x in value)


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
    short final batch; the padded rows are sliced off the outputs. A padded tensor is an inference
    tensor exactly when its source is one: under ``torch.inference_mode`` a plain tensor padded
    there would become one, and a compiled model guards on that (a second compile, a second CUDA
    graph, for an epoch's short last batch).
    """
    import torch

    def pad(t: Any) -> Any:
        missing = size - t.shape[0] if t.dim() > 0 else 0
        if missing <= 0:
            return t
        with torch.inference_mode(t.is_inference()):
            return torch.cat([t, t[-1:].expand(missing, *t.shape[1:])])

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
    if isinstance(value, list) and value and all(type(x) is int for x in value):
        return True  # a tokenizer's list, without the ABC checks: predict() reads every sample's length per call
    return is_number_list(value) and all(isinstance(x, numbers.Integral) for x in value)


def as_tensor(value: Any) -> Any:
    """A list of numbers or a numpy array as a tensor; anything else as it is."""
    import numpy as np
    import torch

    if isinstance(value, np.ndarray) or is_number_list(value):
        return torch.as_tensor(np.asarray(value))
    return value


def token_length(inputs: Mapping[str, Any], keys: Sequence[str] = ()) -> int:
    """Real tokens of one sample: its mask's ones, else the length of its first sequence."""
    mask = inputs.get(MASK_KEY)
    if mask is not None and is_token_sequence(mask):
        return int(sum(mask) if isinstance(mask, (list, tuple)) else mask.sum())
    width = len(inputs[keys[0]]) if keys else stored_width(inputs)
    return width or 0


def stored_width(inputs: Mapping[str, Any]) -> int | None:
    """The width one sample's first token sequence is stored at (its real tokens and its
    padding), or ``None`` when it holds none."""
    key = next((k for k, v in inputs.items() if k not in TARGET_KEYS and is_token_sequence(v)), None)
    return None if key is None else len(inputs[key])


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


def image_of(sample: Any) -> Any:
    """The image of a sample: a float ``(C, H, W)`` tensor alone or as the inputs of
    ``(inputs, target)``; ``None`` otherwise."""
    import torch

    x = sample[0] if isinstance(sample, (tuple, list)) and sample else sample
    if isinstance(x, torch.Tensor) and x.dim() == 3 and x.is_floating_point():
        return x
    return None
