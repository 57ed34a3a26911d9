"""How the GPU headline benchmark (:mod:`benchmarks.gpu`) runs and times one way of running a
workload (a :class:`Row`): the user's loop body, whole epochs with the device synchronized before
the clock is read, under the row's own process-wide settings, and the model alone on a batch
already on the device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

MIN_TIMED_S = 1.0  # each row's timed epochs in one round last at least this


@dataclasses.dataclass
class Flags:
    """The process-wide settings a row runs under (float32 precision through the API this torch
    has: since torch 2.9 mixing the legacy TF32 flags with ``fp32_precision`` raises)."""

    cudnn_benchmark: bool
    precision: dict[str, Any]

    @classmethod
    def read(cls) -> Flags:
        import torch

        from autotune._pristine import precision

        return cls(torch.backends.cudnn.benchmark, precision())

    def set(self) -> None:
        import torch

        from autotune._pristine import set_precision

        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        set_precision(self.precision)


@dataclasses.dataclass
class Row:
    """One way of running a workload: its model, loader, settings, and how its batches move."""

    recipe: str
    model: Any
    loader: Any
    flags: Flags
    batch_size: int
    what: str
    autocast: Any = None  # a torch dtype: the loop runs the model under autocast
    channels_last: bool = False  # the loop turns the images channels-last on the device
    non_blocking: bool = False
    warmup_s: float = 0.0
    rates: list[float] = dataclasses.field(default_factory=list)


def run_batch(row: Row, batch: Any, device: Any) -> Any:
    """The user's loop body: the inputs to the device, the model on them (no labels moved)."""
    import torch

    if isinstance(batch, Mapping):  # token sequences: {"input_ids": (B, L), "attention_mask": (B, L)}
        args, kwargs = (), {k: v.to(device, non_blocking=row.non_blocking) for k, v in batch.items()}
    else:  # (images (B, 3, H, W), labels (B,))
        x = batch[0].to(device, non_blocking=row.non_blocking)
        args, kwargs = (x.contiguous(memory_format=torch.channels_last) if row.channels_last else x,), {}
    if row.autocast is None:
        return row.model(*args, **kwargs)
    with torch.autocast(device.type, dtype=row.autocast):
        return row.model(*args, **kwargs)


def _sync(device: Any) -> None:
    """Wait for the device's queued work (a CUDA device's; the CPU's is done already)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _n(batch: Any) -> int:
    return len(next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0])


def time_epochs(row: Row, device: Any, stock: Flags, min_s: float = MIN_TIMED_S) -> float:
    """Samples/s over whole epochs (at least two, at least ``min_s``) under the row's settings."""

    row.flags.set()
    try:
        _sync(device)
        start, n, epochs = time.perf_counter(), 0, 0
        while True:
            for batch in row.loader:
                run_batch(row, batch, device)
                n += _n(batch)
            epochs += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if epochs >= 2 and elapsed >= min_s:
                return n / elapsed
    finally:
        stock.set()


def warm(row: Row, device: Any, stock: Flags) -> None:
    """Two untimed epochs (compilation, cuDNN's search, the workers' start); the first's seconds
    are the row's ``warmup_s``."""

    row.flags.set()
    try:
        for i in range(2):
            start = time.perf_counter()
            for batch in row.loader:
                run_batch(row, batch, device)
            _sync(device)
            if i == 0:
                row.warmup_s = time.perf_counter() - start
    finally:
        stock.set()


def model_alone(row: Row, device: Any, stock: Flags, n_samples: int, min_s: float = MIN_TIMED_S) -> float:
    """Samples/s of the row's model on one of its batches already on the device, an epoch's worth
    (``n_samples``) of calls at a time: the ceiling, no loader, no copies."""
    import torch

    batch = next(iter(row.loader))
    if isinstance(batch, Mapping):
        moved: Any = {k: v.to(device) for k, v in batch.items()}
    else:
        images = batch[0].to(device)
        moved = [images.contiguous(memory_format=torch.channels_last) if row.channels_last else images]
    resident = dataclasses.replace(row, loader=None, non_blocking=False)
    per_epoch = -(-n_samples // _n(batch))
    row.flags.set()
    try:
        run_batch(resident, moved, device)
        _sync(device)
        start, calls = time.perf_counter(), 0
        while calls < 2 * per_epoch or time.perf_counter() - start < min_s:
            for _ in range(per_epoch):
                run_batch(resident, moved, device)
            calls += per_epoch
            _sync(device)
        return calls * _n(batch) / (time.perf_counter() - start)
    finally:
        stock.set()
