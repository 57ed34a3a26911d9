"""``gather``: a batch of tensor-backed samples read with one index per tensor.

A DataLoader reads a batch sample by sample: ``__getitem__`` for each index, then
``default_collate`` stacks the samples' tensors into new ones. For samples that are rows of a few
big tensors already in memory (a ``TensorDataset``, a dataset whose ``__getitem__`` returns
``self.images[i], self.labels[i]``, or a list of equal-shape samples, stacked once), that is
Python work per sample and one small copy per sample and tensor: on an H100 it held ResNet-50 fed
from 1,024 in-memory 224x224 images to about 3,000 images/s, whatever the model's recipe. A
batched gather reads the same batch as one ``index_select`` per tensor, into pinned memory when
the loader pins (no second copy) or into shared memory in a loader worker.

The batches are the very ones the per-sample path makes: the same values, dtypes, order and
structure (``default_collate``'s: a tuple sample gives a list batch, a dict a dict).

Example:
    >>> import torch
    >>> data = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
    >>> fast = gathered(data)
    >>> loader = torch.utils.data.DataLoader(fast, batch_size=4, collate_fn=as_batch)
    >>> [x.shape[0] for x, y in loader], next(iter(loader))[1].tolist()
    ([4, 2], [0, 1, 2, 3])
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.data import row_sources
from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register
from autotune.knobs.cache import MEMORY_SHARE
from autotune.samples import map_tensors, tensor_leaves

__all__ = ["GatheredDataset", "Gather", "as_batch", "gathered", "gathered_for"]

# Indices of a dataset whose samples are checked to be rows of its tensors before it is gathered
# (every index of a smaller dataset; evenly spread over a larger one).
N_CHECKED = 4096

_COLLATES = {
    "user": "the batches are made by the user's collate_fn",
    "pad": "the batches are made by the padding collate (token sequences of different lengths)",
    "image": "the batches are made by the image padding collate (images of different sizes)",
}


class GatheredDataset:
    """``dataset`` whose batches are gathered: ``__getitems__(indices)`` returns the whole batch
    (one ``index_select`` per tensor of ``fields``, put in ``proto``'s structure), so a DataLoader
    over it takes ``collate_fn=as_batch`` (or a function that only finishes a batch).
    ``dataset[i]`` is still the dataset's own sample.

    Args:
        dataset: The user's dataset.
        fields: One tensor per tensor of a batch, indexed by sample on its first dimension.
        proto: ``default_collate([dataset[0]])``: the batch structure the fields fill.
        pin: Gather into page-locked memory (in the main process, where CUDA is available).
    """

    def __init__(self, dataset: Any, fields: list[Any], proto: Any, pin: bool = False) -> None:
        self.dataset = dataset
        self.fields = fields
        self.proto = proto
        self.pin = pin

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (list, tuple)) or getattr(index, "ndim", 0) == 1:  # a batch's indices
            return self.__getitems__(index)
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        import torch

        index = torch.as_tensor(indices, dtype=torch.long)
        pieces = iter([_take(field, index, self.pin) for field in self.fields])
        return map_tensors(lambda _: next(pieces), self.proto)


def as_batch(batch: Any) -> Any:
    """The collate of a loader over a :class:`GatheredDataset`: its batches come whole."""
    return batch


def _take(source: Any, index: Any, pin: bool) -> Any:
    """``source[index]`` along the first dimension, as a new contiguous tensor."""
    import torch

    if source.device.type != "cpu":  # on the device (device_resident, or the user's): gathered there
        return _take_on_device(source, index)
    shape = (len(index), *source.shape[1:])
    out = None
    if source.device.type == "cpu":
        if torch.utils.data.get_worker_info() is not None:
            # Into shared memory, as default_collate does in a worker: the batch reaches the main
            # process without another copy.
            storage = source._typed_storage()._new_shared(math.prod(shape), device=source.device)
            out = source.new(storage).resize_(shape)
        elif pin and torch.cuda.is_available():
            # Straight into page-locked memory: the loader's pinning finds it pinned and copies nothing.
            out = torch.empty(shape, dtype=source.dtype, pin_memory=True)
    if out is None:
        return source.index_select(0, index)
    return torch.index_select(source, 0, index, out=out)


def _take_on_device(source: Any, index: Any) -> Any:
    """``source[index]`` for a tensor on a device: a slice for consecutive indices (an inference
    pass), else an index copied there (shuffled training batches). Copied either way, so the
    model may write into its batch."""
    n = len(index)
    if n and int(index[-1]) - int(index[0]) == n - 1 and (n == 1 or bool((index[1:] - index[:-1] == 1).all())):
        return source.narrow(0, int(index[0]), n).clone()
    return source.index_select(0, index.to(source.device, non_blocking=True))


def gathered(dataset: Any, *, pin: bool = False, max_bytes: int | None = None) -> GatheredDataset | None:
    """``dataset`` as a :class:`GatheredDataset`, or ``None`` when its samples are not rows of
    tensors: a ``TensorDataset``; a dataset whose every sample's tensors are views of rows of
    tensors it holds (checked at :data:`N_CHECKED` indices, see :func:`autotune.data.row_sources`);
    a list or tuple of samples of one structure, shape and dtype, stacked once here if they take
    at most ``max_bytes`` (default :data:`~autotune.knobs.cache.MEMORY_SHARE` of the machine's memory).
    """
    from torch.utils.data import default_collate

    n = len(dataset)
    if n == 0:
        return None
    if isinstance(dataset, (list, tuple)):
        if max_bytes is None:
            from autotune.env import host_memory_bytes

            max_bytes = int(MEMORY_SHARE * host_memory_bytes())
        fields = _stacked(dataset, max_bytes)
    else:
        fields = row_sources(dataset, _spread(n, N_CHECKED))
    if not fields:
        return None
    proto = default_collate([dataset[0]])
    if len(tensor_leaves(proto)) != len(fields):
        return None
    return GatheredDataset(dataset, fields, proto, pin)


def gathered_for(dataset: Any, state: Any, batching: Any) -> GatheredDataset | None:
    """``dataset`` gathered for a build's loaders (:func:`gathered`), or ``None``: where
    ``state.gather`` is ``"batched"``, ``batching`` collates with ``default_collate`` (no
    collate_fn of the user's, no padding collate) and the samples are rows of tensors. Gathers
    into pinned memory where the loader pins in the main process."""
    from torch.utils.data import default_collate

    if state.gather != "batched" or batching.image_multiple != 1 or batching.collate_fn not in (None, default_collate):
        return None
    kwargs = state.loader_kwargs
    return gathered(dataset, pin=bool(kwargs.get("pin_memory")) and not kwargs.get("num_workers"))


def _spread(n: int, k: int) -> list[int]:
    """``range(n)`` when ``n <= k``, else ``k`` indices evenly spread from 0 to ``n - 1``."""
    if n <= k:
        return list(range(n))
    return sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})


class _NotStackableError(Exception):
    pass


def _flatten(sample: Any, leaves: list[Any]) -> Any:
    """The structure of ``sample`` (types, keys, each leaf's dtype and shape), its leaves
    appended to ``leaves`` in the order ``default_collate`` builds a batch."""
    import numpy as np
    import torch

    if isinstance(sample, torch.Tensor):
        if sample.requires_grad:
            raise _NotStackableError
        leaves.append(sample)
        return ("tensor", sample.dtype, tuple(sample.shape), sample.device)
    if isinstance(sample, np.ndarray) and sample.dtype.kind in "biufc":
        leaves.append(sample)
        return ("array", sample.dtype.str, sample.shape)
    if type(sample) in (int, float, bool):
        leaves.append(sample)
        return (type(sample),)
    if isinstance(sample, Mapping):
        return (type(sample), tuple((k, _flatten(v, leaves)) for k, v in sample.items()))
    if isinstance(sample, (tuple, list)):
        return (type(sample), tuple(_flatten(v, leaves) for v in sample))
    raise _NotStackableError


def _stacked(samples: Sequence[Any], max_bytes: int) -> list[Any] | None:
    """Each leaf of every sample collated once over all samples (``default_collate`` of the
    leaf's column), or ``None`` when the samples differ in structure, shape or dtype (a batch
    of them would then collate differently from a slice of the whole) or exceed ``max_bytes``."""
    from torch.utils.data import default_collate

    first: list[Any] = []
    try:
        structure = _flatten(samples[0], first)
        if len(samples) * sum(_nbytes(x) for x in first) > max_bytes:
            return None
        columns = [[x] for x in first]
        for sample in samples[1:]:
            leaves: list[Any] = []
            if _flatten(sample, leaves) != structure:
                return None
            for column, leaf in zip(columns, leaves, strict=True):
                column.append(leaf)
        return [default_collate(column) for column in columns]
    except (_NotStackableError, TypeError, RuntimeError, OverflowError):
        return None


def _nbytes(leaf: Any) -> int:
    if hasattr(leaf, "element_size"):  # a tensor
        return leaf.numel() * leaf.element_size()
    return int(getattr(leaf, "nbytes", 8))


@register
class Gather(Knob):
    name = "gather"
    side = "loader"
    order = 29
    stage = Stage.LOADER
    choices = ("per_sample", "batched")
    default = "per_sample"
    help = (
        "How a batch is read: per sample (each sample's __getitem__, then default_collate, as a DataLoader "
        "does) or batched (one index per tensor: a TensorDataset's tensors, the tensors __getitem__ slices, or "
        "a list of equal-shape samples stacked once). The same batches, without the host's per-sample work. "
        "Offered where the samples are rows of tensors in memory and no collate_fn of the user's makes batches."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        data = ctx.data
        if data.collate != "default":
            return Offer(["per_sample"], {"batched": _COLLATES.get(data.collate, "a collate makes the batches")})
        if data.in_memory:
            from autotune.env import host_memory_bytes

            need, budget = data.sample_bytes * data.n_samples, int(MEMORY_SHARE * host_memory_bytes())
            if need > budget:
                why = f"stacking the samples once would take {need / 2**30:.1f} GiB, more than {budget / 2**30:.1f} GiB"
                return Offer(["per_sample"], {"batched": why})
            return Offer(list(self.choices))
        if data.tensor_rows:
            return Offer(list(self.choices))
        why = (
            "the samples are not rows of tensors in memory (a TensorDataset, __getitem__ returning self.x[i], "
            "or a list of samples)"
        )
        return Offer(["per_sample"], {"batched": why})

    def applies(self, config: dict[str, Any]) -> bool:
        return not config.get("device_resident", False)  # resident samples are gathered on the device

    def apply(self, state: Any, value: str) -> None:
        state.gather = value
