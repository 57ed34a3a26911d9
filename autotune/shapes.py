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
    from autotune.samples import tensor_leaves

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
    crop: bool = False,
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
        crop: Images batched by autotune: dense maps are cut to each batch's largest image, so
            batches padded to a larger multiple compare with the baseline's (:func:`crop_batch`).
    """
    import torch
    from torch.utils.data import default_collate

    from autotune.samples import (
        batch_size_of,
        call_model,
        concat_outputs,
        image_of,
        outputs_to_cpu,
        pad_batch,
        slice_batch,
        to_device,
    )

    out = Batches(chunk=chunk)
    where = torch.device(device)
    with torch.inference_mode():
        for start in range(0, len(samples), chunk):
            group = list(samples[start : start + chunk])
            batch = (collate or default_collate)(group)
            n = batch_size_of(batch)
            parts = []
            for lo in range(0, n, batch_size):
                part = slice_batch(batch, min(n, lo + batch_size), lo)
                size = min(n, lo + batch_size) - lo
                result = call_model(fn, to_device(pad_batch(part, batch_size), where))
                parts.append(outputs_to_cpu(slice_batch(result, size)))
            joined = concat_outputs(parts)
            if crop:
                sizes = [tuple(image_of(s).shape[1:]) for s in group]
                largest = (max(h for h, _ in sizes), max(w for _, w in sizes))
                images = batch if isinstance(batch, torch.Tensor) else batch[0]  # (b, C, H, W)
                joined = crop_batch(joined, tuple(images.shape[-2:]), largest)
            out.append(joined)
    return out


def _pad_widest(samples: list[Any]) -> Any:
    """A collate that pads 1-D samples with zeros to the widest (the module's example)."""
    import torch

    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)


# Images of different sizes, batched by autotune: "largest" pads each batch to its largest height
# and width; "largest_N" rounds them up to a multiple of N (fewer shapes for a compiler, and the
# strides of a U-Net or a detector's feature pyramid want one).
IMAGE_PADDINGS = ("largest", "largest_8", "largest_16", "largest_32")


def image_sizes(dataset: Any) -> list[tuple[int, int]]:
    """``(height, width)`` of every sample's image, in order (``(0, 0)`` for a sample without one)."""
    from autotune.samples import image_of

    out = []
    for i in range(len(dataset)):
        image = image_of(dataset[i])
        out.append((0, 0) if image is None else (int(image.shape[1]), int(image.shape[2])))
    return out


def size_keys(sizes: Sequence[tuple[int, int]]) -> list[float]:
    """A sort key per image: its aspect ratio in steps of 1/8, then its area, so that a batch of
    neighbours in this order holds images of one shape and similar size.

    Example:
        >>> size_keys([(32, 64), (32, 32), (30, 60)])
        [16000002048.0, 8000001024.0, 16000001800.0]
    """
    return [round(8 * w / max(h, 1)) * 1e9 + h * w for h, w in sizes]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_images(samples: Sequence[Any], multiple: int = 1) -> Any:
    """Collate samples whose images differ in size: each image padded with zeros at the bottom
    and right to the batch's largest height and width, rounded up to ``multiple``; a target with
    the image's height and width (a mask, a score map) is padded the same way; then batched as
    ``default_collate`` does.

    Example:
        >>> import torch
        >>> batch = pad_images([(torch.ones(3, 5, 7), 0), (torch.ones(3, 6, 4), 1)], multiple=8)
        >>> tuple(batch[0].shape), batch[1].tolist()
        ((2, 3, 8, 8), [0, 1])
    """
    import torch
    from torch.utils.data import default_collate

    from autotune.samples import image_of

    sizes = [tuple(image_of(s).shape[1:]) for s in samples]
    height = _round_up(max(h for h, _ in sizes), multiple)
    width = _round_up(max(w for _, w in sizes), multiple)

    def pad(value: Any, size: tuple[int, ...]) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[-2:]) == size:
            return torch.nn.functional.pad(value, (0, width - size[1], 0, height - size[0]))
        return value

    padded = []
    for sample, size in zip(samples, sizes, strict=True):
        if isinstance(sample, (tuple, list)):
            padded.append(type(sample)(pad(v, size) for v in sample))
        else:
            padded.append(pad(sample, size))
    return default_collate(padded)


def dense_crop(out: Any, padded: tuple[int, int], sizes: Sequence[tuple[int, int]]) -> list[Any]:
    """A batch's outputs as one output per sample, each dense map cut to its own image's size.

    A dense map is an output of 3 or more axes whose last two follow the padded batch's height
    and width at one scale (a score map at half resolution: ``(b, 2, H / 2, W / 2)``); each
    sample's map keeps its image's share (``ceil(h * scale)`` rows and so on). Other outputs
    are each sample's row as it is.

    Args:
        out: The model's outputs on the batch, on the CPU.
        padded: The batch's padded ``(height, width)``.
        sizes: Each sample's own ``(height, width)``.
    """
    import math

    from autotune.samples import map_tensors, slice_batch

    def cut_for(h: int, w: int) -> Callable[[Any], Any]:
        def cut(t: Any) -> Any:
            if t.dim() < 2:
                return t
            sh, sw = t.shape[-2] / padded[0], t.shape[-1] / padded[1]
            if t.dim() < 3 or abs(sh - sw) > 1e-6 or sh == 0 or sh > 1:
                return t
            return t[..., : math.ceil(h * sh), : math.ceil(w * sw)]

        return cut

    pieces = []
    for i, (h, w) in enumerate(sizes):
        one = slice_batch(out, i + 1, i)
        pieces.append(map_tensors(lambda t, c=cut_for(h, w): c(t)[0] if t.dim() > 0 else t, one))
    return pieces


def crop_batch(out: Any, padded: tuple[int, int], size: tuple[int, int]) -> Any:
    """A batch's dense maps (as :func:`dense_crop` finds them) cut to ``size``, the batch's
    largest image: what the batch holds beyond it is padding a larger multiple added."""
    import math

    from autotune.samples import map_tensors

    def cut(t: Any) -> Any:
        if t.dim() < 3:
            return t
        sh, sw = t.shape[-2] / padded[0], t.shape[-1] / padded[1]
        if abs(sh - sw) > 1e-6 or sh == 0 or sh > 1:
            return t
        return t[..., : math.ceil(size[0] * sh), : math.ceil(size[1] * sw)]

    return map_tensors(cut, out)
