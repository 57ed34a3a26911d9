"""How samples become batches: the user's collate (or an automatic padding collate), padding
trimmed to each batch's real tokens, and batches of similar lengths, with every output put
back in dataset order (:mod:`autotune.batching.outputs`, re-exported here).

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

from autotune.batching.outputs import Rows, gather_outputs, inverse_order, join_samples, split_samples
from autotune.samples import (
    MASK_KEY,
    SequenceInfo,
    as_tensor,
    is_number_list,
    is_token_sequence,
    sample_inputs,
    sequence_info,
    stored_width,
    token_length,
)

__all__ = [
    "GROUPINGS",
    "PADDINGS",
    "Batching",
    "Rows",
    "MASK_KEY",
    "SequenceInfo",
    "fit_width",
    "gather_outputs",
    "inverse_order",
    "join_samples",
    "lengths_and_width",
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
    return lengths_and_width(dataset)[0]


def lengths_and_width(dataset: Any) -> tuple[list[int], int | None]:
    """The real length of every sample of ``dataset``, in order, and the one width every
    sample is stored at (pre-padded text: batched as given, every batch has one shape), or
    ``None`` where stored widths differ.

    Example:
        >>> import torch
        >>> ids, mask = torch.ones(4, dtype=torch.long), torch.tensor([1, 1, 0, 0])
        >>> lengths_and_width([{"input_ids": ids, "attention_mask": mask}] * 2)
        ([2, 2], 4)
        >>> lengths_and_width([{"input_ids": ids}, {"input_ids": ids[:3]}])
        ([4, 3], None)
    """
    out, widths = [], set()
    for i in range(len(dataset)):
        inputs = sample_inputs(dataset[i])
        out.append(token_length(inputs) if inputs is not None else 0)
        widths.add(stored_width(inputs) if inputs is not None else None)
    return out, widths.pop() if len(widths) == 1 else None


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
    widened to a multiple of ``multiple``. A batch narrower than that multiple is padded out to
    it (:func:`_widen`): a collate that pads to each batch's longest (natural-length text) then
    gives a few widths rather than one per length, so a static compile builds a few graphs instead
    of running past dynamo's recompile limit. A batch without an attention mask is returned as it
    is. The cut tensors are contiguous, as a batch that needed no cut is."""
    import torch

    inputs = sample_inputs(batch)
    mask = None if inputs is None else inputs.get(MASK_KEY)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return batch
    n, width = mask.shape
    lo, hi = _span(mask)
    keep = -(-(hi - lo) // multiple) * multiple
    if keep > width:
        return _widen(batch, mask, keep)
    hi = min(width, lo + keep)
    lo = hi - keep
    if (lo, hi) == (0, width):
        return batch

    # Copied, not viewed: a view's row stride is the padded width, a full batch's its own, and
    # dynamo guards on strides: a compile with shapes as symbols compiled real MiniLM twice
    # (11 s more per build, in every trial, confirmation worker and user's process).
    return _map_columns(batch, n, width, lambda t: t[:, lo:hi].contiguous())


def _map_columns(batch: Any, n: int, width: int, fn: Callable[[Any], Any]) -> Any:
    """``batch`` with ``fn`` applied to every ``(n, width, ...)`` tensor in it (nested mappings,
    tuples and lists walked), every other value kept."""
    import torch

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == n and value.shape[1] == width:
            return fn(value)
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(batch)


def _widen(batch: Any, mask: Any, width: int) -> Any:
    """``batch`` padded to ``width`` positions on the side its padding is on (left when the last
    column is real in every row and the first is not): the mask with 0, every other
    ``(batch, seq)`` tensor with the value it holds at a padded position (its pad id, or the
    labels' ignore index), 0 where it has none; wider tensors with zeros.

    Example:
        >>> import torch
        >>> b = {"input_ids": torch.tensor([[5, 6, 1], [7, 1, 1]]), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
        >>> _widen(b, b["attention_mask"], 4)["input_ids"].tolist()
        [[5, 6, 1, 1], [7, 1, 1, 1]]
    """
    import torch

    n, have = mask.shape
    padded = mask == 0
    left = bool((mask[:, -1] != 0).all()) and bool(padded[:, 0].any())

    def grow(value: Any) -> Any:
        fill = value[padded][0] if value.dim() == 2 and bool(padded.any()) else 0
        extra = value.new_full((n, width - have, *value.shape[2:]), fill)
        return torch.cat([extra, value] if left else [value, extra], 1)

    return _map_columns(batch, n, have, grow)


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
        so each batch holds samples of similar length; a window's short batch (the dataset's
        last) holds its longest samples, so that few of them are padded to the longest: 300
        sentences of real text in batches of 32 ran 9% more tokens with the short batch
        holding the shortest.

        Example:
            >>> Batching(batch_size=2, grouping=4, lengths=[3, 9, 5, 7, 1]).plan(5)
            [[1], [3, 2], [0, 4]]
        """
        lengths = self.lengths if lengths is None else lengths
        size = self.batch_size
        if not self.grouping or lengths is None:
            return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        window = size * self.grouping
        out = []
        for start in range(0, n, window):
            ids = sorted(range(start, min(start + window, n)), key=lambda i: -lengths[i])
            first = len(ids) % size or size
            out += [ids[:first]] + [ids[i : i + size] for i in range(first, len(ids), size)]
        return out

    def sampler(self, n: int) -> list[list[int]] | None:
        """A ``batch_sampler`` for a DataLoader over ``n`` samples, or ``None`` for plain batching."""
        return self.plan(n) if self.grouping and self.lengths is not None else None

    def batches(self, samples: Sequence[Any], lengths: Sequence[int] | None = None) -> Iterator[tuple[list[int], Any]]:
        """``(indices, batch)`` over ``samples`` in the order this batching runs them."""
        for ids in self.plan(len(samples), lengths):
            yield ids, self.collate([samples[i] for i in ids])
