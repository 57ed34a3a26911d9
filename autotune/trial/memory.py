"""A trial's own peak memory: the CUDA allocator's peak, or the growth of the resident set on a
CPU; and the host memory its batches in flight would take, priced before it starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from autotune.errors import TrialError

__all__ = ["check_host_memory", "in_flight", "memory_mark"]

# The share of free shared memory (/dev/shm: the workers' batches) and of available host memory
# (pinned batches) the batches in flight may take: the rest is the model's and the dataset's.
FLIGHT_SHARE = 0.5


def _status_mib(field: str) -> float | None:
    """A ``VmRSS``/``VmHWM`` line of ``/proc/self/status`` in MiB, or ``None`` off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _rss_mib() -> float:
    rss = _status_mib("VmRSS")
    if rss is not None:
        return rss
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def memory_mark(device: str | torch.device, collect: bool = True) -> float:
    """Start a trial's memory account and return its reference in MiB.

    CUDA: what earlier trials left in the allocator's cache is freed and the peak counter reset,
    so the peak is this trial's alone (the reference is 0). CPU: the process's peak resident
    set is reset to the current one, which is the reference: the trial's peak is reported as
    its increase over it, not as the long-lived worker's high-water mark. ``collect=False``
    skips the collection of Python's heap first (a tenth of a second or more in a worker
    holding a tokenizer's samples): for a build measured again, whose garbage went before.
    """
    import gc

    device = torch.device(device)
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return 0.0
    try:  # Linux: writing 5 resets this process's peak resident set size (VmHWM) to the current one.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _rss_mib()


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = _status_mib("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def in_flight(config: Mapping[str, Any], batch_bytes: int) -> tuple[int, int]:
    """Bytes of ``config``'s batches in flight: (in loader workers' shared memory, in all).

    Each worker keeps ``prefetch_factor`` batches ready in shared memory; pinning copies each
    of those once more, and the feeder thread (``feed_ahead``) holds as many again.

    Example:
        >>> in_flight(dict(num_workers=8, prefetch_factor=4, pin_memory=True), 154 * 2**20)[0] // 2**30
        4
    """
    from autotune.config import values_of

    knobs = values_of(config)
    workers = 0 if knobs.device_resident else int(knobs.num_workers or 0)
    queued = workers * int(knobs.prefetch_factor or 2) if workers else 0
    shared = queued * batch_bytes
    pinned = (queued + 1) * batch_bytes if knobs.pin_memory and not knobs.device_resident else 0
    fed = int(knobs.feed_ahead or 0) * batch_bytes
    return shared, shared + pinned + fed + batch_bytes


def _free(path: str) -> int | None:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _available() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or unsupported platform
        return None


def check_host_memory(
    config: Mapping[str, Any], batch_bytes: int, shm_free: int | None = None, available: int | None = None
) -> None:
    """Raise before a trial whose batches in flight (:func:`in_flight`) would not fit
    :data:`FLIGHT_SHARE` of the free shared memory or of the available host memory: 8 workers
    with 8 batches ahead of a 154 MB batch fill a container's /dev/shm and kill the workers.

    Raises:
        TrialError: kind ``oom``, saying what it would take and what is free.
    """
    from autotune.config import values_of

    shared, total, knobs = *in_flight(config, batch_bytes), values_of(config)
    shm_free = _free("/dev/shm") if shm_free is None and shared else shm_free
    if shared and shm_free is not None and shared > FLIGHT_SHARE * shm_free:
        raise TrialError(
            "oom",
            f"not started: {knobs.num_workers} loader workers x {knobs.prefetch_factor} batches "
            f"ahead take about {shared / 2**30:.1f} GiB of shared memory, and /dev/shm has "
            f"{shm_free / 2**30:.1f} GiB free",
        )
    available = _available() if available is None else available
    if available is not None and total > FLIGHT_SHARE * available:
        raise TrialError(
            "oom",
            f"not started: its batches in flight take about {total / 2**30:.1f} GiB of host memory, and "
            f"{available / 2**30:.1f} GiB are available",
        )
