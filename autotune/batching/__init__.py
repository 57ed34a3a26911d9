"""How samples become batches: the user's collate (or an automatic padding collate), padding
trimmed to each batch's real tokens, and batches of similar lengths, with every output put
back in dataset order.

Sequence samples are dicts (or ``(inputs, target)`` with dict inputs) whose inputs hold 1-D
integer tensors and, usually, an ``attention_mask`` (1 = real token, 0 = padding). A batch of
them is ``(batch, seq)`` per input. Everything that iterates a tuned pipeline (the timed
windows, the guard, :func:`autotune.dataloader`, :func:`autotune.predict`, the exported
predictor) batches through one :class:`Batching`, so what was measured is what runs.

Example:
    >>> import torch
    >>> samples = [{"input_ids": torch.ones(n, dtype=torch.long), "attention_mask": torch.ones(n, dtype=torch.long)}
    ...            for n in (3, 7, 2, 6)]
    >>> b = Batching(batch_size=2, collate_fn=pad_collate, padding="trim", grouping=2, lengths=[3, 7, 2, 6])
    >>> b.plan(4)  # longest first within a window of 2 batches
    [[1, 3], [0, 2]]
    >>> b.collate([samples[i] for i in (1, 3)])["input_ids"].shape
    torch.Size([2, 7])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from autotune.errors import InputError
from autotune.samples import (
    MASK_KEY,
    SequenceInfo,
    as_tensor,
    is_number_list,
    is_token_sequence,
    sample_inputs,
    sequence_info,
    token_length,
)

__all__ = [
    "GROUPINGS",
    "PADDINGS",
    "Batching",
    "MASK_KEY",
    "SequenceInfo",
    "fit_width",
    "gather_outputs",
    "inverse_order",
    "join_samples",
    "lengths_of",
    "pad_collate",
    "sequence_info",
    "split_samples",
    "token_outputs",
    "trim_batch",
]

# "as_given": batches as the collate makes them; "trim": cut to the batch's longest real
# sequence; "trim_N": the same, rounded up to a multiple of N (fewer shapes for a compiler).
PADDINGS = ("as_given", "trim", "trim_8", "trim_16", "trim_32")
# 0: batches in dataset order; k: samples sorted by length within windows of k batches.
GROUPINGS = (0, 4, 16, 64)


def lengths_of(dataset: Any) -> list[int]:
    """The real length of every sample of ``dataset``, in order."""
    out = []
    for i in range(len(dataset)):
        inputs = sample_inputs(dataset[i])
        out.append(token_length(inputs) if inputs is not None else 0)
    return out


def fit_width(outputs: Any, width: int, like: Any, tokens: Sequence[int] = ()) -> Any:
    """Token-level leaves of ``outputs`` cut or zero-padded to ``width`` positions, so they line
    up with a batch of that width (``like``: a leaf-for-leaf reference of which leaves are
    token-level, as :func:`join_samples` made them; ``tokens``: the float ``(batch, seq)`` leaves
    that are token-level too, as :func:`token_outputs` found them)."""
    import torch

    index = iter(range(1 << 62))

    def fit(t: Any) -> Any:
        i = next(index)
        token_level = t.dim() >= 3 or (t.dim() == 2 and (not t.is_floating_point() or i in tokens))
        if not token_level or t.shape[1] == width:
            return t
        if t.shape[1] > width:
            return t[:, :width]
        pad = t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))
        return torch.cat([t, pad], 1)

    from autotune.samples import map_tensors

    return map_tensors(fit, outputs) if like is not None else outputs


def pad_collate(samples: Sequence[Any], pad_values: Mapping[str, int] | None = None) -> Any:
    """Collate samples whose 1-D integer inputs differ in length: each such input (a tensor, a
    numpy array or a tokenizer's list of ints) is padded on the right to the batch's longest with
    its pad value (``pad_values``, default 0; the mask's padding is always 0), then batched as
    ``default_collate`` does.

    Example:
        >>> import torch
        >>> batch = pad_collate([{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8])}])
        >>> batch["input_ids"].tolist()
        [[5, 6, 7], [8, 0, 0]]
    """
    import torch
    from torch.utils.data import default_collate

    def pad(items: list[Any], key: str | None) -> Any:
        if all(is_token_sequence(x) for x in items):
            seqs = [as_tensor(x) for x in items]
            if len({len(x) for x in seqs}) > 1:
                fill = 0 if key == MASK_KEY else (pad_values or {}).get(key, 0)
                return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=fill)
            return torch.stack(seqs)
        if isinstance(items[0], Mapping):
            return {k: pad([x[k] for x in items], k) for k in items[0]}
        if is_number_list(items[0]):  # a tokenizer's list of floats: one tensor per sample
            return torch.stack([as_tensor(x) for x in items])
        return default_collate(items)

    if isinstance(samples[0], Mapping):
        return pad(list(samples), None)
    if isinstance(samples[0], (tuple, list)):
        return type(samples[0])(pad([s[i] for s in samples], None) for i in range(len(samples[0])))
    return default_collate(list(samples))


def _span(mask: Any) -> tuple[int, int]:
    """Columns ``[lo, hi)`` that hold a real token in any row of a ``(batch, seq)`` mask."""
    import torch

    real = torch.nonzero(mask.sum(0) > 0).flatten()
    if real.numel() == 0:
        return 0, 1
    return int(real[0]), int(real[-1]) + 1


def trim_batch(batch: Any, multiple: int = 1) -> Any:
    """``batch`` with its padding columns cut: every ``(batch, seq, ...)`` tensor keeps the
    columns where the attention mask has a real token in some row (right or left padding),
    widened to a multiple of ``multiple`` (never beyond the batch's own width). A batch without
    an attention mask is returned as it is."""
    import torch

    inputs = sample_inputs(batch)
    mask = None if inputs is None else inputs.get(MASK_KEY)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return batch
    n, width = mask.shape
    lo, hi = _span(mask)
    keep = min(width, -(-(hi - lo) // multiple) * multiple)
    hi = min(width, lo + keep)
    lo = hi - keep
    if (lo, hi) == (0, width):
        return batch

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == n and value.shape[1] == width:
            return value[:, lo:hi]
        if isinstance(value, Mapping):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(cut(v) for v in value)
        return value

    return cut(batch)


def token_outputs(call: Callable[[Any], Any], batch: Any) -> tuple[int, ...]:
    """The float ``(batch, seq)`` outputs that hold one value per token (the start and end logits
    of question answering), as indices in ``tensor_leaves`` order: those whose width follows the
    batch's when ``call`` runs on ``batch`` with its last column dropped. A width that merely
    equals the batch's (a 128-wide embedding of 128-token batches) does not follow it; a model
    that cannot run one column narrower has none."""
    import torch

    from autotune.samples import tensor_leaves

    inputs = sample_inputs(batch)
    mask = None if inputs is None else inputs.get(MASK_KEY)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return ()
    n, width = mask.shape
    leaves = tensor_leaves(call(batch))
    maybe = [i for i, t in enumerate(leaves) if t.dim() == 2 and t.is_floating_point() and t.shape[1] == width]
    if not maybe:
        return ()

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (n, width):
            return value[:, : width - 1]
        if isinstance(value, Mapping):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(cut(v) for v in value)
        return value

    try:
        narrow = tensor_leaves(call(cut(batch)))
    except Exception:  # a model bound to one width: its outputs are judged as vectors
        return ()
    return tuple(i for i in maybe if i < len(narrow) and tuple(narrow[i].shape) == (n, width - 1))


@dataclasses.dataclass
class Batching:
    """How a configuration batches samples.

    Attributes:
        batch_size: Samples per batch.
        collate_fn: The base collate (the user's, :func:`pad_collate`, or ``default_collate``).
        padding: One of :data:`PADDINGS`.
        grouping: One of :data:`GROUPINGS` (0: dataset order).
        lengths: Real length of every sample, needed for ``grouping``.
        tokens: The float ``(batch, seq)`` outputs that are token-level (:func:`token_outputs`).
        image_multiple: Images batched by autotune (:func:`autotune.shapes.pad_images`): each
            batch padded to its largest height and width rounded up to this multiple.
    """

    batch_size: int
    collate_fn: Callable[[list[Any]], Any] | None = None
    padding: str = "as_given"
    grouping: int = 0
    lengths: Sequence[int] | None = None
    tokens: Sequence[int] = ()
    image_multiple: int = 1

    def collate(self, samples: list[Any]) -> Any:
        """One batch of ``samples``, padded as this batching says."""
        from torch.utils.data import default_collate

        if self.image_multiple > 1:
            from autotune.shapes import pad_images

            return pad_images(samples, self.image_multiple)

        return self.finish((self.collate_fn or default_collate)(samples))

    def finish(self, batch: Any) -> Any:
        """A batch the base collate made (or a batched gather, :mod:`autotune.knobs.gather`),
        padded as this batching says."""
        if self.padding == "as_given":
            return batch
        return trim_batch(batch, 1 if self.padding == "trim" else int(self.padding.split("_")[1]))

    def plan(self, n: int, lengths: Sequence[int] | None = None) -> list[list[int]]:
        """The sample indices of each batch, in the order the batches run. With grouping, the
        indices are sorted by length (longest first) within windows of ``grouping`` batches,
        so each batch holds samples of similar length."""
        lengths = self.lengths if lengths is None else lengths
        size = self.batch_size
        if not self.grouping or lengths is None:
            return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        window = size * self.grouping
        out = []
        for start in range(0, n, window):
            ids = sorted(range(start, min(start + window, n)), key=lambda i: -lengths[i])
            out += [ids[i : i + size] for i in range(0, len(ids), size)]
        return out

    def sampler(self, n: int) -> list[list[int]] | None:
        """A ``batch_sampler`` for a DataLoader over ``n`` samples, or ``None`` for plain batching."""
        return self.plan(n) if self.grouping and self.lengths is not None else None

    def batches(self, samples: Sequence[Any], lengths: Sequence[int] | None = None) -> Iterator[tuple[list[int], Any]]:
        """``(indices, batch)`` over ``samples`` in the order this batching runs them."""
        for ids in self.plan(len(samples), lengths):
            yield ids, self.collate([samples[i] for i in ids])


def split_samples(outputs: Any, batch: Any, tokens: Sequence[int] = ()) -> list[Any]:
    """A batch's outputs as one output per sample. A token-level tensor (``(batch, seq, ...)``
    with the batch's sequence width, or a float ``(batch, seq)`` leaf whose index in
    ``tensor_leaves`` order is in ``tokens``, see :func:`token_outputs`) keeps each sample's real
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
