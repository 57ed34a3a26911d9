"""``device_prefetch`` and ``feed_ahead``: the host's share of each batch off the model's path.

Without them, each batch is made (gathered or collated, pinned) and then copied to the device on
the thread and the stream the model runs on, so host work, copy and model take turns.

``device_prefetch``: :class:`DevicePrefetcher` issues the next batch's copy on a side CUDA stream
before it hands over the current batch, so the copy runs while the model computes. The consumer's
stream waits on the copy's event before it reads a batch, and each copied tensor is recorded as
used by that stream, so the caching allocator does not hand its memory to another copy while the
model still reads it. Copies are non-blocking: from pinned memory (``pin_memory``) they leave the
host free as well.

``feed_ahead`` (N > 0): a background thread makes the batches (the loader's gather or collate,
its pinning) and issues their copies, keeping up to N ready, so the host's work overlaps the model
as well as the copy. Pinned batches come from PyTorch's caching host allocator, which hands a
freed pinned block to the next batch of its size: the N batches in flight are the ring of pinned
buffers. The thread stops when the loop over the batches ends, breaks or is dropped (its loader's
workers with it); an exception raised in it reaches the consumer with its own traceback.

The batches either yields are on the device already; moving them there again
(:func:`autotune.data.to_device`) returns the same tensors, without a copy.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register
from autotune.samples import tensor_leaves, to_device

__all__ = ["DevicePrefetch", "DevicePrefetcher", "FeedAhead", "fed"]

# Seconds the consumer waits for the feeder thread to end after the loop stops (it checks
# between batches; a batch being made is finished first).
JOIN_S = 30.0


class DevicePrefetcher:
    """``loader``'s batches on ``device``, each copied on a side CUDA stream while the batch
    before it is used. On any other device it is ``loader`` itself, batch for batch. With
    ``ahead`` > 0, a background thread makes up to ``ahead`` batches (and issues their copies)
    while the consumer uses the current one, on any device.

    It has the loader's length and attributes (``batch_size``, ``dataset``, ``batch_sampler``...).

    Args:
        loader: Any iterable of batches (a DataLoader).
        device: Where the batches go: ``"cuda:N"`` to copy them there ahead; ``"cpu"`` (or
            ``None``) leaves them where the loader puts them.
        ahead: Batches the feeder thread keeps ready (0: no thread).

    Example:
        >>> import torch
        >>> loader = torch.utils.data.DataLoader(torch.arange(6.0), batch_size=4)
        >>> batches = DevicePrefetcher(loader, "cpu")
        >>> len(batches), [b.tolist() for b in batches]
        (2, [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]])
    """

    def __init__(self, loader: Any, device: Any, ahead: int = 0) -> None:
        import torch

        self.loader = loader
        self.device = torch.device(device if device is not None else "cpu")
        self.ahead = int(ahead)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("loader", "device", "ahead"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if self.ahead > 0:
            return self._fed()
        if self.device.type != "cuda":
            return iter(self.loader)
        return self._prefetched()

    def _fed(self) -> Iterator[Any]:
        """The batches, made (and copied, on CUDA) by a thread up to ``ahead`` in advance."""
        import torch

        cuda = self.device.type == "cuda"
        ready: queue.Queue[Any] = queue.Queue(maxsize=self.ahead)
        stop = threading.Event()
        side = torch.cuda.Stream(self.device) if cuda else None
        thread = threading.Thread(
            target=_feed, args=(self.loader, self.device, side, ready, stop), name="autotune-feeder", daemon=True
        )
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                batch, event = item
                if event is not None:
                    consumer = torch.cuda.current_stream(self.device)
                    consumer.wait_event(event)
                    for tensor in tensor_leaves(batch):
                        if tensor.device.type == "cuda":
                            tensor.record_stream(consumer)
                yield batch
        finally:
            stop.set()
            while thread.is_alive():  # unblock a feeder waiting for room, then let it see ``stop``
                try:
                    ready.get(timeout=0.05)
                except queue.Empty:
                    thread.join(JOIN_S)
                    break

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


class _Failed:
    """An exception raised on the feeder thread, handed to the consumer to raise."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def _feed(loader: Any, device: Any, side: Any, ready: queue.Queue[Any], stop: threading.Event) -> None:
    """The feeder thread: each batch of ``loader`` (copied to ``device`` on ``side`` when it is a
    CUDA stream) put in ``ready`` with its copy's event, then :data:`_END`, or the exception."""
    import torch

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        if side is not None:
            torch.cuda.set_device(device)
        batches = iter(loader)
        for batch in batches:
            if stop.is_set():
                break
            event = None
            if side is not None:
                with torch.cuda.stream(side):
                    batch = to_device(batch, device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(side)
            if not put((batch, event)):
                break
        else:
            put(_END)
        del batches  # a DataLoader's iterator: its workers shut down here, on this thread
    except BaseException as error:  # the consumer raises it, traceback and all
        put(_Failed(error))


def fed(loader: Any, state: Any, device: Any = None) -> Any:
    """``loader`` behind a :class:`DevicePrefetcher` where the build's ``device_prefetch`` (with a
    CUDA ``device``) or ``feed_ahead`` asks for one, else ``loader`` itself."""
    copy = device if state.device_prefetch and device is not None and str(device).startswith("cuda") else None
    ahead = int(getattr(state, "feed_ahead", 0) or 0)
    if copy is None and ahead == 0:
        return loader
    return DevicePrefetcher(loader, copy, ahead)


@register
class FeedAhead(Knob):
    name = "feed_ahead"
    side = "loader"
    order = 29
    stage = Stage.LOADER
    choices = (0, 2, 4)
    default = 0
    help = (
        "Make batches on a background thread, up to this many ahead (0: on the model's thread): the loader's "
        "gather or collate, its pinning and, with device_prefetch, the copy's launch overlap the model instead "
        "of taking turns with it. CUDA only, where one host thread feeds a fast device."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.env.is_cuda:
            return Offer(list(self.choices))
        why = "on the CPU the host's threads run the model; loader workers make batches off them"
        return Offer([0], {str(v): why for v in self.choices[1:]})

    def apply(self, state: Any, value: int) -> None:
        state.feed_ahead = int(value)


@register
class DevicePrefetch(Knob):
    name = "device_prefetch"
    side = "loader"
    order = 29
    stage = Stage.LOADER
    choices = (False, True)
    default = False
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
