"""``device_prefetch``: batches copied to the GPU one batch ahead, on a side CUDA stream.

Without it, each batch is copied to the device on the stream the model runs on, so the copy and
the model's kernels take turns. :class:`DevicePrefetcher` issues the next batch's copy on a side
stream before it hands over the current batch, so the copy runs while the model computes. The
consumer's stream waits on the copy's event before it reads a batch, and each copied tensor is
recorded as used by that stream, so the caching allocator does not hand its memory to another
copy while the model still reads it. Copies are non-blocking: from pinned memory
(``pin_memory``) they leave the host free as well.

The batches it yields are on the device already; moving them there again
(:func:`autotune.data.to_device`) returns the same tensors, without a copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register
from autotune.samples import tensor_leaves, to_device

__all__ = ["DevicePrefetch", "DevicePrefetcher"]


class DevicePrefetcher:
    """``loader``'s batches on ``device``, each copied on a side CUDA stream while the batch
    before it is used. On any other device it is ``loader`` itself, batch for batch.

    It has the loader's length and attributes (``batch_size``, ``dataset``, ``batch_sampler``...).

    Args:
        loader: Any iterable of batches (a DataLoader).
        device: Where the batches go: ``"cuda:N"`` to prefetch; ``"cpu"`` passes them through.

    Example:
        >>> import torch
        >>> loader = torch.utils.data.DataLoader(torch.arange(6.0), batch_size=4)
        >>> batches = DevicePrefetcher(loader, "cpu")
        >>> len(batches), [b.tolist() for b in batches]
        (2, [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]])
    """

    def __init__(self, loader: Any, device: Any) -> None:
        import torch

        self.loader = loader
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("loader", "device"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            return iter(self.loader)
        return self._prefetched()

    def _prefetched(self) -> Iterator[Any]:
        import torch

        side = torch.cuda.Stream(self.device)
        batches = iter(self.loader)
        ahead = self._copy(batches, side)
        while ahead is not None:
            batch, ready = ahead
            torch.cuda.current_stream(self.device).wait_event(ready)
            ahead = self._copy(batches, side)  # the next copy runs while this batch is used
            yield batch

    def _copy(self, batches: Iterator[Any], side: Any) -> tuple[Any, Any] | None:
        """The next batch of ``batches`` copied on ``side``, and the event its copy ends at."""
        import torch

        try:
            batch = next(batches)
        except StopIteration:
            return None
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(side):
            moved = to_device(batch, self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        for tensor in tensor_leaves(moved):
            if tensor.device.type == "cuda":
                # Allocated on the side stream, read on the consumer's: its memory must not be
                # reused until the consumer's work queued when it is freed has run.
                tensor.record_stream(consumer)
        return moved, ready


@register
class DevicePrefetch(Knob):
    name = "device_prefetch"
    order = 29
    stage = Stage.LOADER
    choices = (False, True)
    default = False
    # The trial's loader; training mode builds its own from the loader keyword arguments.
    modes = ("inference",)
    help = (
        "Copy the next batch to the GPU on a side CUDA stream while the model runs on the current one, so "
        "copies and compute overlap (non-blocking from pinned memory). CUDA only."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.env.is_cuda:
            return Offer([False, True])
        return Offer([False], {"true": "batches are copied ahead to a CUDA device only; on the CPU there is no copy"})

    def apply(self, state: Any, value: bool) -> None:
        state.device_prefetch = value
