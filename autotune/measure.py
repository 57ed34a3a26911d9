"""The timing protocol. Knows nothing about Optuna.

End to end: iterate the real DataLoader, move each batch to the device, run the model,
synchronise the device before reading the clock. The first batches (and any compilation) are
timed apart as ``compile_s``. Then several windows of at least ``window_s`` seconds each; the
reported throughput is the median window, with min, max and coefficient of variation.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from .build import BuildState, make_loader, settings_active, unwrap
from .data import model_inputs, to_device

__all__ = ["MeasureSettings", "measure", "call_model", "size_bytes", "window_stats"]


@dataclasses.dataclass(frozen=True)
class MeasureSettings:
    """How long and how often to time.

    Attributes:
        n_windows: Timed windows per measurement; the median is reported.
        window_s: Minimum length of one window in seconds.
        warmup_batches: Batches run before timing starts (compilation happens here).
    """

    n_windows: int = 5
    window_s: float = 0.4
    warmup_batches: int = 3


def call_model(model: Any, batch: Any) -> Any:
    """Run ``model`` on a batch already on its device."""
    args, kwargs = model_inputs(batch)
    return model(*args, **kwargs)


def _epochs(loader: Any) -> Iterator[Any]:
    # A new epoch re-creates the loader's iterator, and with it non-persistent workers: that
    # cost is part of the pipeline, so it is inside the timed windows.
    while True:
        yield from loader


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 resets this process's peak resident set size (VmHWM).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def size_bytes(model: Any) -> tuple[int, int]:
    """Bytes of the tuned model's serialized weights (int8 packed, pruned shapes real), plain
    and zlib-compressed. The compressed size is what an archive ships, so zeroed weights from
    unstructured pruning count there; it is what the ``size`` objective minimizes."""
    from ._quantize import serialized_bytes

    data = serialized_bytes(unwrap(model), raw=True)
    return len(data), len(zlib.compress(data, 1))


def window_stats(windows: list[float], latencies: list[float]) -> dict[str, float]:
    """Throughput of the timed windows (median, min, max, coefficient of variation) and latency
    p50/p95 in milliseconds."""
    lat = sorted(latencies)
    mean = statistics.fmean(windows)
    return {
        "samples_per_s": statistics.median(windows),
        "samples_per_s_min": min(windows),
        "samples_per_s_max": max(windows),
        "cov": statistics.pstdev(windows) / mean if mean else 0.0,
        "latency_ms_p50": lat[len(lat) // 2],
        "latency_ms_p95": lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))],
    }


def measure(state: BuildState, dataset: Any, settings: MeasureSettings = MeasureSettings()) -> dict[str, Any]:
    """Time ``state`` end to end over ``dataset``.

    Returns:
        ``samples_per_s`` (median window) with ``samples_per_s_min``/``_max`` and ``cov``;
        ``latency_ms_p50``/``_p95`` per batch (device time from the copy to the outputs);
        ``peak_mem_mib``; ``compile_s`` (warm-up); ``timed_s``; ``n_windows``; ``batch_size``.
    """
    device = torch.device(state.device)
    # Every timed batch has the same shape: no recompilation inside a window.
    drop_last = len(dataset) >= state.batch_size
    loader = make_loader(dataset, state, drop_last=drop_last)
    batches = _epochs(loader)
    use_events = device.type == "cuda"
    latencies: list[float] = []
    windows: list[float] = []
    _reset_peak(device)
    try:
        with settings_active(state.settings), torch.inference_mode():
            start = time.perf_counter()
            for _ in range(settings.warmup_batches):
                call_model(state.model, to_device(next(batches), device, non_blocking=state.non_blocking))
            _sync(device)
            compile_s = time.perf_counter() - start
            timed_start = time.perf_counter()
            for _ in range(settings.n_windows):
                events: list[tuple[Any, Any]] = []
                n_samples = 0
                w_start = time.perf_counter()
                while True:
                    batch = next(batches)
                    if use_events:
                        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        begin.record()
                        call_model(state.model, to_device(batch, device, non_blocking=state.non_blocking))
                        end.record()
                        events.append((begin, end))
                    else:
                        b_start = time.perf_counter()
                        call_model(state.model, to_device(batch, device))
                        latencies.append((time.perf_counter() - b_start) * 1e3)
                    n_samples += state.batch_size if drop_last else len(dataset)
                    if time.perf_counter() - w_start >= settings.window_s:
                        break
                _sync(device)
                windows.append(n_samples / (time.perf_counter() - w_start))
                latencies += [b.elapsed_time(e) for b, e in events]
            timed_s = time.perf_counter() - timed_start
    finally:
        batches.close()  # shuts down the loader's workers
        del loader
    return {
        **window_stats(windows, latencies),
        "peak_mem_mib": _peak_mib(device),
        "compile_s": compile_s,
        "timed_s": timed_s,
        "n_windows": settings.n_windows,
        "batch_size": state.batch_size,
    }
