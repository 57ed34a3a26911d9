"""Outputs whose shape changes from batch to batch: a recognizer's sequence over the width of
images a collate padded to each batch's widest, a detector's score maps.

Such outputs cannot be joined along the batch axis. The guard keeps them as :class:`Batches`,
one model output per batch of the metric's fixed batches (the baseline batch size, as the
collate makes them), so a candidate and the baseline are compared on the same inputs, batch by
batch, and the user's metric gets each batch's own outputs.

Example:
    >>> import torch
    >>> chunks = [torch.zeros(2, 3), torch.zeros(2, 5)]
    >>> same_shapes(chunks)
    False
    >>> out = run_chunks(lambda x: x * 2, [torch.ones(n) for n in (3, 3, 5)], 2, 2, _pad_widest, "cpu")
    >>> [tuple(b.shape) for b in out]
    [(2, 3), (1, 5)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Batches", "run_chunks", "same_shapes"]


class Batches(list):
    """One output per batch of fixed batches of the samples (``chunk`` samples each, in sample
    order), each as the model returned it for that batch: its batch axis first, its other axes
    as the batch made them. A plain list otherwise; ``chunk`` is the batches' size."""

    def __init__(self, items: Sequence[Any] = (), chunk: int = 1) -> None:
        super().__init__(items)
        self.chunk = chunk

    def __reduce__(self) -> Any:  # a worker sends these back to the parent
        return (Batches, (list(self), self.chunk))


def same_shapes(chunks: Sequence[Any]) -> bool:
    """Whether the outputs of several batches have the same leaves, of the same shapes beyond
    the batch axis, so that they join along it."""
    from autotune.data import tensor_leaves

    if not chunks:
        return True
    first = [tuple(t.shape[1:]) for t in tensor_leaves(chunks[0])]
    return all([tuple(t.shape[1:]) for t in tensor_leaves(c)] == first for c in chunks[1:])


def run_chunks(
    fn: Callable[..., Any],
    samples: Sequence[Any],
    chunk: int,
    batch_size: int,
    collate: Callable[[list[Any]], Any] | None,
    device: Any,
) -> Batches:
    """``fn``'s outputs on ``samples`` as :class:`Batches`: the samples in batches of ``chunk``
    (made by ``collate``, default ``default_collate``), each run in slices of ``batch_size``
    padded to a full slice (a compiled model sees one batch size) and joined again: the slices
    of one batch share its shape.

    Args:
        fn: The model, or an artifact called like it.
        samples: Uncollated samples.
        chunk: Samples per batch (the metric's).
        batch_size: Samples per call of ``fn``.
        collate: Turns a list of samples into a batch.
        device: Where ``fn`` runs; outputs come back on the CPU.
    """
    import torch
    from torch.utils.data import default_collate

    from autotune.data import (
        batch_size_of,
        call_model,
        concat_outputs,
        outputs_to_cpu,
        pad_batch,
        slice_batch,
        to_device,
    )

    out = Batches(chunk=chunk)
    where = torch.device(device)
    with torch.inference_mode():
        for start in range(0, len(samples), chunk):
            batch = (collate or default_collate)(list(samples[start : start + chunk]))
            n = batch_size_of(batch)
            parts = []
            for lo in range(0, n, batch_size):
                part = slice_batch(batch, min(n, lo + batch_size), lo)
                size = min(n, lo + batch_size) - lo
                result = call_model(fn, to_device(pad_batch(part, batch_size), where))
                parts.append(outputs_to_cpu(slice_batch(result, size)))
            out.append(concat_outputs(parts))
    return out


def _pad_widest(samples: list[Any]) -> Any:
    """A collate that pads 1-D samples with zeros to the widest (the module's example)."""
    import torch

    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
