"""The timing protocol. Knows nothing about Optuna.

End to end: iterate the real DataLoader, move each batch to the device, run the model,
synchronise the device before reading the clock. The first batches (and any compilation) are
timed apart as ``compile_s``. Then several windows of at least ``window_s`` seconds each; the
reported throughput is the median window (for token sequences, or where a small dataset's short
last batch is timed, whose batches differ in cost: all samples over all the windows' time), with
min, max and coefficient of variation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
import zlib
from typing import Any

import torch

from autotune.knobs.state import BuildState, unwrap
from autotune.samples import batch_size_of, call_model, tensor_leaves, to_device
from autotune.trial.build import make_loader, settings_active
from autotune.trial.epochs import (  # noqa: F401  (re-exported: their former home)
    EPOCH_WINDOW_CAP,
    WHOLE_EPOCH_BATCHES,
    _aligned_at,
    _Epochs,
    _window_done,
    timing_batches,
)
from autotune.trial.interference import GpuSharing, Interference, run_pids
from autotune.trial.memory import _peak_mib, memory_mark
from autotune.trial.phase import say
from autotune.trial.warmup import compile_counts, compiles_per_shape, fallback_note, shape_batches

__all__ = [
    "GpuSharing",
    "Interference",
    "MeasureSettings",
    "run_pids",
    "call_model",
    "draw_seed",
    "measure",
    "memory_mark",
    "is_busy",
    "noise_reason",
    "size_bytes",
    "window_stats",
]


@dataclasses.dataclass(frozen=True)
class MeasureSettings:
    """How long and how often to time.

    Attributes:
        n_windows: Timed windows per measurement; the median is reported.
        window_s: Minimum length of one window in seconds.
        warmup_batches: Batches run before timing starts (compilation happens here); a compiled
            build's first measurement over a small epoch of several shapes runs whole epochs
            (see :func:`timing_batches`).

        max_cov: Largest coefficient of variation of the windows of a clean measurement.
        max_others_cpu: Largest share of the machine's CPU time (0-1) that other processes may
            use during the windows of a clean measurement.
        n_remeasure: Extra measurements of a trial whose first one was noisy (by the two
            limits above), before it is kept and marked ``noisy``.
        stop_share: With throughput first, a trial whose timed windows run under this share
            of the best trial's samples/s so far stops once :data:`STOP_MIN_BATCHES` batches are
            timed, unguarded (``stopped``): far below the best, more windows and the guard
            cannot make it a contender. 0: never.
    """

    n_windows: int = 5
    window_s: float = 0.4
    warmup_batches: int = 3
    max_cov: float = 0.05
    max_others_cpu: float = 0.10
    n_remeasure: int = 2
    stop_share: float = 0.75


# A measurement stops early (``stop_below``) only once this many batches were timed: a window
# of one or two slow batches (a loader worker's first decode, say) is no evidence.
STOP_MIN_BATCHES = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def noise_reason(result: dict[str, Any], settings: MeasureSettings) -> str | None:
    """Why a measurement is not clean (its windows disagree, or others used the CPU), or ``None``."""
    return "; ".join(_noise_causes(result, settings).values()) or None


def is_busy(result: dict[str, Any], settings: MeasureSettings) -> bool:
    """Whether other processes were measured using the CPU (above ``max_others_cpu``) or the GPU
    during ``result``'s windows: a busy machine, as opposed to windows that merely disagree."""
    causes = _noise_causes(result, settings)
    return "cpu" in causes or "gpu" in causes


def _noise_causes(result: dict[str, Any], settings: MeasureSettings) -> dict[str, str]:
    causes = {}
    if result.get("cov", 0.0) > settings.max_cov:
        causes["windows"] = f"its windows disagree (CoV {result['cov']:.1%} > {settings.max_cov:.0%})"
    if result.get("others_cpu", 0.0) > settings.max_others_cpu:
        causes["cpu"] = f"other processes used {result['others_cpu']:.0%} of the CPU (> {settings.max_others_cpu:.0%})"
    if result.get("gpu_others"):
        causes["gpu"] = f"{result['gpu_others']} other process(es) computed on the GPU"
    if result.get("recompiles"):
        # A shape the warm-up had not run compiled on the clock: the windows timed a compile.
        causes["compile"] = f"torch.compile compiled {result['recompiles']} new shape(s) inside its timed windows"
    return causes


def size_bytes(model: Any, artifact: dict[str, Any] | None = None, compress: bool = True) -> tuple[int, int | None]:
    """Bytes of the tuned model's serialized weights (int8 packed, pruned shapes real), plain
    and zlib-compressed (``None`` without ``compress``). The compressed size is what an archive
    ships, so zeroed weights from unstructured pruning count there; it is what the ``size``
    objective minimizes. A model that runs an exported file (TorchScript, ONNX Runtime,
    OpenVINO: ``artifact``) is that file's size with the weights it keeps beside it (OpenVINO's
    ``model.bin``, ONNX's external data)."""
    from pathlib import Path

    from autotune.compress.quantize import serialized_bytes

    if artifact is not None and artifact.get("path") and Path(artifact["path"]).is_file():
        path = Path(artifact["path"])
        beside = [path.with_suffix(".bin")] if path.suffix == ".xml" else [path.with_name(path.name + ".data")]
        data = b"".join(p.read_bytes() for p in [path, *beside] if p.is_file())
    else:
        data = serialized_bytes(unwrap(model), raw=True)
    return len(data), compressed_len(data) if compress else None


# Compressed lengths of the weights a worker has measured, by their digest. zlib at level 1
# takes 3-4 s for the 90 MB of a MiniLM's float weights on one core, most of an early-stopped
# trial's time; batching, padding, autocast, threads and a runtime's float builds leave the same
# bytes trial after trial, and their digest takes 0.1 s.
_COMPRESSED: dict[bytes, int] = {}
_COMPRESSED_KEPT = 32


def compressed_len(data: bytes) -> int:
    """``len(zlib.compress(data, 1))``, computed once per distinct ``data`` in this process.

    Example:
        >>> data = bytes(1000)
        >>> compressed_len(data) == len(zlib.compress(data, 1)) == compressed_len(bytes(1000))
        True
    """
    key = hashlib.sha256(data).digest()
    if key not in _COMPRESSED:
        while len(_COMPRESSED) >= _COMPRESSED_KEPT:
            _COMPRESSED.pop(next(iter(_COMPRESSED)))
        _COMPRESSED[key] = len(zlib.compress(data, 1))
    return _COMPRESSED[key]


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


def draw_seed(seed: int, *names: Any) -> int:
    """A reproducible seed for one measurement's draw of batches, from the run's ``seed`` and
    what names the measurement (a trial's configuration, a round's number).

    Example:
        >>> draw_seed(0, "round", 1) == draw_seed(0, "round", 1) != draw_seed(0, "round", 2)
        True
    """
    import json

    return zlib.crc32(json.dumps([seed, *names], sort_keys=True, default=str).encode())


def _cache_counts() -> tuple[int, int]:
    """Graphs inductor read from its FX-graph cache, and built, in this process so far."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, 0
    inductor = utils.counters["inductor"]
    return int(inductor["fxgraph_cache_hit"]), int(inductor["fxgraph_cache_miss"])


def _compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (0 before it is first used)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["frames"]["total"])


def _window(
    state: BuildState,
    batches: _Epochs,
    window_s: float,
    latencies: list[float],
    sizes: set[int],
    align: int | None = None,
    clock: bool = False,
) -> tuple[int, int, float]:
    """One timed window: (samples, batches, seconds), each batch's latency added to
    ``latencies`` (device time from the copy to the outputs, in ms) and its size to ``sizes``;
    with ``align``, it ends only where the epoch is at that position (see :func:`measure`); with
    ``clock``, once past ``window_s``, wherever the epoch is."""
    device = torch.device(state.device)
    # A DataLoader's batches are on the CPU already: moving them there would only add a walk
    # over the batch per call, which a small model's baseline would pay and a user's loop not.
    move = device.type != "cpu"
    events: list[tuple[Any, Any]] = []
    n_samples = n_batches = n_work = 0
    w_start = time.perf_counter()
    while True:
        batch = next(batches)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            call_model(state.model, to_device(batch, device, non_blocking=state.non_blocking))
            end.record()
            events.append((begin, end))
        else:
            b_start = time.perf_counter()
            call_model(state.model, to_device(batch, device) if move else batch)
            latencies.append((time.perf_counter() - b_start) * 1e3)
        batches.end_epoch()  # where the epoch ended, its iterator stops as a user's pass stops it
        size = batch_size_of(batch)
        sizes.add(size)
        n_samples += size
        n_batches += 1
        n_work += _work(batch)
        elapsed = time.perf_counter() - w_start
        if align is not None:
            done = _aligned(elapsed, window_s, batches, align)
        else:
            done = elapsed >= window_s if clock else _window_done(elapsed, window_s, batches)
        if done:
            break
    _sync(device)
    w_s = time.perf_counter() - w_start
    latencies += [b.elapsed_time(e) for b, e in events]
    return n_samples, n_batches, w_s, n_work


def _aligned(elapsed_s: float, window_s: float, batches: _Epochs, align: int) -> bool:
    """Whether the last window may end: past its minimum length, where the epoch is at ``align``
    (where the first window began), so the windows together hold whole epochs. It waited for an
    epoch's end or the cap too, which the alignment already stands for: a pick of real text ran
    its last window 1.3 s where 0.4 s held whole epochs, the plain baseline 2.2 s for 0.7 s."""
    return elapsed_s >= window_s and batches.position == align


def _stats(
    windows: list[float], work: list[float], latencies: list[float], totals: list[Any], uneven: bool, cpu: bool
) -> dict:
    """:func:`window_stats` of a measurement's windows, for batches that differ in cost (``uneven``:
    text lengths, a short last batch) over all samples and all the windows' time; with the
    windows' samples (``timed_samples``) and, on the ``cpu``, the model's own seconds in them
    (``model_s``: each batch's call, timed apart from its loading; ``None`` on a GPU, whose
    latencies are device time)."""
    stats = window_stats(windows, latencies)
    stats.update(timed_samples=totals[0], model_s=sum(latencies) / 1e3 if cpu else None)
    if uneven:
        # A window of cheap batches runs fast, so the median window overstates what an epoch
        # gets (rates of unequal work do not average). All samples over all the time does not.
        stats["samples_per_s"] = totals[0] / totals[1]
        # Nor are windows of other lengths noise: quiet windows of grouped real text ran 20% apart
        # and each trial was measured three times (60-90 s). Their work per second agrees.
        stats["cov"] = window_stats(work, latencies)["cov"]
    return stats


def _work(batch: Any) -> int:
    """A batch's work, to compare windows by: its largest tensor's elements (batch x width of tokens)."""
    return max((t.numel() for t in tensor_leaves(batch)), default=0)


def _shapes_first(dataset: Any, state: BuildState, batches: _Epochs, seed: int) -> list[Any]:
    """One batch of each shape of a long epoch of token sequences, for a build that compiles per
    shape and has not run them yet; else nothing. A short epoch is warmed whole
    (:func:`timing_batches`), and a long one's ``warmup_batches`` see few of its lengths, so
    the windows would time the others' compiles."""
    extras = state.extras
    if batches.n_batches <= WHOLE_EPOCH_BATCHES or extras is None or extras.lengths is None or extras.images:
        return []
    if not compiles_per_shape(state) or state.info.get("shapes_warmed"):
        return []
    return shape_batches(make_loader(dataset, state, drop_last=True, timing=True, seed=seed), extras.lengths)


def _far_below(stop_below: float | None, n_batches: int, totals: list[Any], compiled_before: int) -> bool:
    """Whether a measurement may stop: at least :data:`STOP_MIN_BATCHES` batches timed, under
    ``stop_below`` samples/s so far, and no shape compiled in its windows (a window slowed by a
    compile the warm-up had not seen says nothing of the configuration's speed)."""
    if stop_below is None or n_batches < STOP_MIN_BATCHES or totals[0] / totals[1] >= stop_below:
        return False
    return _compiled_frames() == compiled_before


def measure(
    state: BuildState,
    dataset: Any,
    settings: MeasureSettings = MeasureSettings(),
    *,
    mem_mark: float | None = None,
    seed: int = 0,
    stop_below: float | None = None,
    clock_windows: bool = False,
) -> dict[str, Any]:
    """Time ``state`` end to end over ``dataset``.

    Args:
        state: The built configuration.
        dataset: The samples its DataLoader reads.
        settings: How long and how often to time.
        mem_mark: The reference of :func:`memory_mark` taken at the trial's start; ``None``
            takes one here, so the build's memory is not counted.
        seed: Which shuffled order token sequences are read in (see
            :func:`~autotune.trial.build.make_loader`): give each measurement its own, and
            configurations compared in one round the same.
        stop_below: Samples/s under which the measurement stops after a window, once at least
            :data:`STOP_MIN_BATCHES` batches were timed (a configuration far slower than the
            best so far needs no more timing to be ruled out); the result then has ``stopped``
            set and fewer windows.
        clock_windows: Where the last window ends at the first's position (a short epoch of
            batches unequal in cost) and no epoch restarts the loader's workers, the windows
            before it end on the clock, not at an epoch's end: the last one makes whole epochs
            of them all. A confirmation round's first window of the plain Hugging Face baseline
            ran to the epoch's end, and its last a whole epoch more to reach the alignment
            (3.6 s where one epoch, 1.8 s, held the same batches).

    Returns:
        ``samples_per_s`` (median window; where timed batches differ in size or length, samples
        over the time of all windows) with
        ``samples_per_s_min``/``_max`` and ``cov``;
        ``latency_ms_p50``/``_p95`` per batch (device time from the copy to the outputs);
        ``others_cpu`` (mean share of the machine's CPU other processes used during the
        windows) and ``others_cpu_max``; ``peak_mem_mib`` (the trial's own: see
        :func:`memory_mark`); ``compile_s`` (warm-up); ``recompiles`` (graphs torch.compile
        compiled during the timed windows: new shapes the warm-up did not see, timed as they
        would be in use; a cause of noise, see :func:`noise_reason`); ``compile_fallbacks``
        (frames of this build dynamo gave up compiling, past its recompile limit: their batches
        ran eager) with ``compile_note`` saying so where there are any; ``timed_s``; ``model_s``
        (on the CPU, the model's own seconds in the windows: each batch's call, timed apart from
        its loading; ``None`` on a GPU, whose latencies are device time) of ``timed_samples``;
        ``n_windows`` (the windows timed); ``stopped``; ``batch_size``.

    Example:
        >>> import torch
        >>> from autotune.trial.build import build
        >>> from autotune.config import Config
        >>> state = build(torch.nn.Linear(8, 2), Config(batch_size=4), "cpu")
        >>> data = [torch.randn(8) for _ in range(16)]
        >>> r = measure(state, data, MeasureSettings(n_windows=2, window_s=0.01, warmup_batches=1))
        >>> r["samples_per_s"] > 0 and r["n_windows"] == 2
        True
    """
    device = torch.device(state.device)
    batches, n_warm = timing_batches(dataset, state, settings.warmup_batches, seed)
    latencies: list[float] = []
    windows: list[float] = []
    work: list[float] = []  # each window's elements per second (see _work)
    totals = [0, 0.0]  # samples and seconds over every window
    timed_batches, sizes, others = 0, set(), []  # sizes: the timed batches' sizes
    probe = Interference()
    mark = memory_mark(device) if mem_mark is None else mem_mark
    sharing = GpuSharing(device)
    try:
        cached_before, fell_back = _cache_counts(), compile_counts()[1]
        with settings_active(state.settings), torch.inference_mode():
            start = time.perf_counter()
            say("compiling" if state.compile_mode != "none" else "warming up")
            for batch in _shapes_first(dataset, state, batches, seed):
                call_model(state.model, to_device(batch, device, non_blocking=state.non_blocking))
            for _ in range(n_warm):
                call_model(state.model, to_device(next(batches), device, non_blocking=state.non_blocking))
            _sync(device)
            state.info["shapes_warmed"] = True  # every shape of the epoch has run on this build
            compile_s = time.perf_counter() - start
            batches.begin_epoch()  # the windows begin an epoch where their start changes what they time
            cache_hits, cache_misses = (now - then for now, then in zip(_cache_counts(), cached_before, strict=True))
            compiled_before = _compiled_frames()
            sharing.start()  # over the windows, not the warm-up: a compile is no other's use
            say("timing")
            timed_start = time.perf_counter()
            align = _aligned_at(batches)
            clock = clock_windows and align is not None and not batches.restarts
            for i in range(settings.n_windows):
                probe.start()
                last = align if i == settings.n_windows - 1 else None
                n_samples, n_batches, w_s, n_work = _window(
                    state, batches, settings.window_s, latencies, sizes, last, clock
                )
                windows.append(n_samples / w_s)
                work.append(n_work / w_s)
                totals[0], totals[1] = totals[0] + n_samples, totals[1] + w_s
                others.append(probe.stop())
                timed_batches += n_batches
                if _far_below(stop_below, timed_batches, totals, compiled_before):
                    break
            timed_s = time.perf_counter() - timed_start
            recompiles = _compiled_frames() - compiled_before
            gpu_users = sharing.stop()
    finally:
        batches.close()  # shuts down the loader's workers
    # Frames dynamo gave up compiling (its recompile limit): their batches ran eager, warm-up
    # and windows alike, as in a user's loop. The figure is that pipeline's, and says so.
    state.info["compile_fallbacks"] = state.info.get("compile_fallbacks", 0) + compile_counts()[1] - fell_back
    uneven = (state.extras is not None and state.extras.lengths is not None) or len(sizes) > 1 or not batches.alike
    stats = _stats(windows, work, latencies, totals, uneven, device.type == "cpu")
    return {
        **stats,
        "others_cpu": statistics.fmean(others),
        "others_cpu_max": max(others),
        "gpu_others": gpu_users,
        "peak_mem_mib": max(0.0, _peak_mib(device) - mark),
        "compile_s": compile_s,
        "compile_cache_hits": cache_hits,
        "compile_cache_misses": cache_misses,
        "recompiles": recompiles,
        "compile_fallbacks": state.info["compile_fallbacks"],
        **({"compile_note": fallback_note(state.info["compile_fallbacks"])} if state.info["compile_fallbacks"] else {}),
        "timed_s": timed_s,
        "n_windows": len(windows),
        "stopped": len(windows) < settings.n_windows,
        "batch_size": state.batch_size,
    }
