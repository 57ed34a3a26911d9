"""What else ran while a trial's windows were timed: other processes' CPU time, and processes
outside the run computing on its GPU."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["GpuSharing", "Interference", "run_pids"]


class Interference:
    """How much of the machine's CPU other processes used while a window ran.

    Busy time of the whole machine (``/proc/stat``: user, nice, system, irq, softirq and steal,
    the time a hypervisor gave to other guests) less the CPU time of this process and its
    children (DataLoader workers), as a share of the machine's capacity over the window.
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._n_cpus = psutil.cpu_count() or 1
        self._start: tuple[float, float, float] | None = None

    def _busy(self) -> float:
        t = self._psutil.cpu_times()
        return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))

    def _own(self) -> float:
        total = 0.0
        try:
            t = self._me.cpu_times()
            total = t.user + t.system + t.children_user + t.children_system
            for child in self._me.children(recursive=True):
                try:
                    c = child.cpu_times()
                    total += c.user + c.system
                except self._psutil.Error:
                    pass
        except self._psutil.Error:
            pass
        return total

    def start(self) -> None:
        self._start = (time.perf_counter(), self._busy(), self._own())

    def stop(self) -> float:
        """Share of the machine's CPU capacity (0-1) that others used since :meth:`start`."""
        if self._start is None:
            return 0.0
        wall = time.perf_counter() - self._start[0]
        others = (self._busy() - self._start[1]) - (self._own() - self._start[2])
        self._start = None
        # /proc/stat counts in ticks (10 ms): short windows round; clamp to the possible range.
        return min(1.0, max(0.0, others / max(wall * self._n_cpus, 1e-9)))


def run_pids() -> set[int]:
    """This run's processes: this one, its ancestors (the user's process that called
    :func:`autotune.optimize`, a test runner, a notebook kernel) and every descendant of its
    parent (the run's other trial workers, loader workers). Each may hold a CUDA context on the
    GPU the run measures on; none of them is "another process"."""
    import psutil

    me = psutil.Process()
    pids = {me.pid}
    try:
        parents = me.parents()
        pids.update(p.pid for p in parents)
        family = parents[0].children(recursive=True) if parents else me.children(recursive=True)
        pids.update(p.pid for p in family)
    except psutil.Error:
        pass
    return pids


class GpuSharing:
    """How many processes outside this run computed on ``device``'s GPU while windows ran.

    NVML (the ``nvidia-ml-py`` package) keeps per-process utilization samples; :meth:`stop`
    counts the processes, outside :func:`run_pids`, with a sample of nonzero SM or memory
    utilization since :meth:`start`. A process that merely holds a context (an idle notebook,
    the user's own process) is not counted. ``None`` where it cannot be known (no NVML, no
    permission, a MIG slice, a driver without per-process samples): unknown, not zero.
    """

    def __init__(self, device: torch.device) -> None:
        self._handle: Any = None
        self._since = 0
        if device.type != "cuda":
            return
        try:
            import os

            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            # NVML numbers the GPUs of the machine; CUDA_VISIBLE_DEVICES may renumber them for torch.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                index = int(visible.split(",")[index])
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            self._handle = None

    def start(self) -> None:
        self._since = int(time.time() * 1e6)  # NVML's sample clock: microseconds since the epoch

    def stop(self) -> int | None:
        """Processes outside this run that used the GPU since :meth:`start`, or ``None``."""
        if self._handle is None:
            return None
        nvml = self._nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(self._handle, self._since)
        except nvml.NVMLError as exc:
            if isinstance(exc, getattr(nvml, "NVMLError_NotFound", ())):
                return 0  # no process had a sample since the start: nobody used it
            return None
        except Exception:
            return None
        mine = run_pids()
        if samples and not any(s.pid in mine for s in samples):
            # This worker computed in the windows, yet no sample names it: NVML speaks of
            # another PID namespace (a container's), so whose samples these are is unknown.
            return None
        return len({s.pid for s in samples if s.pid not in mine and (s.smUtil or s.memUtil)})
