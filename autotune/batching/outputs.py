"""Outputs put back per sample: a batch's outputs split into one per sample (each token-level
output cut to the sample's real tokens), every sample's output gathered in dataset order from
batches that ran in another order, and per-sample outputs joined again with their token mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import InputError
from autotune.samples import MASK_KEY, sample_inputs

__all__ = ["Rows", "gather_outputs", "inverse_order", "join_samples", "split_samples"]


def split_samples(outputs: Any, batch: Any, tokens: Sequence[int] = ()) -> list[Any]:
    """A batch's outputs as one output per sample. A token-level tensor (``(batch, seq, ...)``
    with the batch's sequence width, or a float ``(batch, seq)`` leaf whose index in
    ``tensor_leaves`` order is in ``tokens``, see :func:`autotune.batching.token_outputs`) keeps each sample's real
    tokens only, so the same sample gives the same output whatever it was batched with."""
    import torch

    from autotune.samples import map_tensors, slice_batch

    inputs = sample_inputs(batch)
    mask = None if inputs is None else inputs.get(MASK_KEY)
    n = len(mask) if isinstance(mask, torch.Tensor) else None
    pieces = []
    count = n if n is not None else _batch_len(outputs)
    for i in range(count):
        one = slice_batch(outputs, i + 1, i)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            real, index = mask[i].bool(), iter(range(1 << 62))

            def keep(t: Any, real: Any = real, index: Any = index) -> Any:
                listed = next(index) in tokens and t.dim() == 2
                token_level = listed or _token_level(t, real.shape[0])
                return t[:, real.to(t.device)] if token_level and t.shape[1] == real.shape[0] else t

            one = map_tensors(keep, one)
        pieces.append(one)
    return pieces


def gather_outputs(chunks: list[tuple[Any, Any]], order: Sequence[int]) -> Sequence[Any]:
    """Every sample's output in dataset order, from the outputs of batches that ran in another order.

    Each leaf is joined once over all batches and permuted by index (no loop per sample over
    tensors); a token-level leaf (see :func:`split_samples`) keeps each sample's real tokens.

    Args:
        chunks: ``(outputs, mask)`` of each batch in the order they ran, on the CPU; ``mask`` is
            the batch's ``(batch, seq)`` attention mask, or ``None``.
        order: The dataset index of every sample, in the order the batches ran (a sequence, or a
            ``long`` tensor), or what :func:`inverse_order` made of it, which a caller that
            gathers the same order often can keep.

    Returns:
        One output per sample, without a batch axis, structured as the model's outputs: a
        :class:`Rows` when the model returns one tensor of the same shape for every batch (no
        Python object per sample until one is asked for), else a list.

    Example:
        >>> import torch
        >>> out = gather_outputs([(torch.tensor([[2.0], [0.0]]), None), (torch.tensor([[1.0]]), None)], [2, 0, 1])
        >>> [o.tolist() for o in out]
        [[0.0], [1.0], [2.0]]
    """
    import torch

    from autotune.samples import map_tensors, tensor_leaves

    if not chunks:
        return []
    inverse = inverse_order(order)
    per_batch = [tensor_leaves(out) for out, _ in chunks]
    leaves = [_gather_leaf([(b[j], m) for b, (_, m) in zip(per_batch, chunks, strict=True)], inverse)
              for j in range(len(per_batch[0]))]  # fmt: skip
    template = chunks[0][0]
    if isinstance(template, torch.Tensor):
        return leaves[0]
    leaves = [list(leaf) if isinstance(leaf, Rows) else leaf for leaf in leaves]
    rows = zip(*leaves, strict=True) if leaves else ([] for _ in range(len(inverse)))
    return [map_tensors(lambda _, it=iter(row): next(it), template) for row in rows]


def inverse_order(order: Any) -> Any:
    """For ``order`` (every sample's dataset index, in the order the batches ran): the position
    each dataset index ran at, as a ``long`` tensor, or ``None`` when the batches ran in dataset
    order (nothing to permute). A :class:`_Inverse` given back is returned as it is.

    Example:
        >>> inverse_order([2, 0, 1]).positions.tolist(), inverse_order(range(3)).positions
        ([1, 2, 0], None)
    """
    import torch

    if isinstance(order, _Inverse):
        return order
    index = order if isinstance(order, torch.Tensor) else torch.as_tensor(list(order), dtype=torch.long)
    if torch.equal(index, torch.arange(len(index))):
        return _Inverse(None, len(index))
    positions = torch.empty(len(index), dtype=torch.long)
    positions[index] = torch.arange(len(index))
    return _Inverse(positions, len(index))


@dataclasses.dataclass(frozen=True)
class _Inverse:
    """Where each dataset index ran (``positions``; ``None``: in dataset order), for ``n`` samples."""

    positions: Any
    n: int

    def __len__(self) -> int:
        return self.n


class Rows(Sequence):
    """Every sample's output, in dataset order, held as one stacked tensor: ``rows[i]`` is sample
    ``i``'s output (a view, without the batch axis) and ``rows.tensor`` all of them at once.

    A list of one tensor per sample would cost a Python object per sample, more than a small
    model's forward pass; this sequence makes one only when a sample is asked for.

    Example:
        >>> import torch
        >>> rows = Rows(torch.arange(6.0).reshape(3, 2))
        >>> len(rows), rows[1].tolist(), [r.tolist() for r in rows][-1], rows.tensor.shape
        (3, [2.0, 3.0], [4.0, 5.0], torch.Size([3, 2]))
    """

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return Rows(self.tensor[index])
        return self.tensor[index]

    def __iter__(self) -> Any:
        return iter(self.tensor.unbind(0))

    def __repr__(self) -> str:
        return f"Rows({len(self)} samples of shape {tuple(self.tensor.shape[1:])}, {self.tensor.dtype})"


def _gather_leaf(parts: list[tuple[Any, Any]], inverse: Any) -> list[Any]:
    """One output leaf of every batch (with its batch's mask) as per-sample pieces in dataset order."""
    import torch

    if all(t.dim() == 0 for t, _ in parts):  # a scalar output has no sample axis: each sample shares it
        return [parts[0][0]] * len(inverse)
    token = [isinstance(m, torch.Tensor) and m.dim() == 2 and _token_level(t, m.shape[1]) for t, m in parts]
    if not any(token) and len({tuple(t.shape[1:]) for t, _ in parts}) == 1:
        joined = torch.cat([t for t, _ in parts]) if len(parts) > 1 else parts[0][0]
        return Rows(joined if inverse.positions is None else joined.index_select(0, inverse.positions))
    pieces: list[Any] = []
    for (t, m), cut in zip(parts, token, strict=True):
        if cut:  # the real positions of every row, row after row, then split by each row's count
            real = m.to(torch.bool)
            pieces += list(t[real].split(real.sum(1).tolist()))
        else:
            pieces += list(t.unbind(0))
    return pieces if inverse.positions is None else [pieces[i] for i in inverse.positions.tolist()]


def _token_level(t: Any, width: int) -> bool:
    """Whether an output holds one value per position of a ``width``-wide batch: ``(b, seq, ...)``,
    or ``(b, seq)`` integers (a float ``(b, n)`` is a vector, whatever ``n`` is)."""
    if t.dim() < 2 or t.shape[1] != width:
        return False
    return t.dim() >= 3 or not t.is_floating_point()


def _batch_len(outputs: Any) -> int:
    from autotune.samples import tensor_leaves

    leaves = [t for t in tensor_leaves(outputs) if t.dim() > 0]
    if not leaves:
        raise InputError("The model's outputs have no batch axis to split into samples.")
    return int(leaves[0].shape[0])


def join_samples(pieces: list[Any]) -> tuple[Any, Any]:
    """Per-sample outputs joined into one batch-like structure, and its token mask.

    Token-level leaves of different lengths are padded with zeros to the longest; the mask
    (``(n, longest)``, 1 on real tokens) lets fidelity judge real positions only. Returns
    ``(outputs, mask)``; ``mask`` is ``None`` when no leaf is token-level.
    """
    import torch

    mask: list[Any] = [None]

    def join(items: list[Any]) -> Any:
        head = items[0]
        if isinstance(head, torch.Tensor):
            if head.dim() >= 2 and len({t.shape[1] for t in items}) > 1:
                width = max(t.shape[1] for t in items)
                out = head.new_zeros((len(items), width, *head.shape[2:]))
                real = torch.zeros(len(items), width, dtype=torch.bool)
                for i, t in enumerate(items):
                    out[i, : t.shape[1]] = t[0]
                    real[i, : t.shape[1]] = True
                if mask[0] is None or mask[0].shape == real.shape:
                    mask[0] = real
                return out
            return torch.cat(items) if head.dim() > 0 else head
        if isinstance(head, Mapping):
            return {k: join([x[k] for x in items]) for k in head}
        if isinstance(head, (tuple, list)):
            return type(head)(join([x[i] for x in items]) for i in range(len(head)))
        return head

    return join(pieces), mask[0]
