"""A trial's own peak memory: the CUDA allocator's peak, or the growth of the resident set on a CPU."""

from __future__ import annotations

import torch

__all__ = ["memory_mark"]


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
