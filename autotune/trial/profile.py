"""Where a pipeline's time goes: one short ``torch.profiler`` window over a built configuration.

The pipeline runs as it is timed (:mod:`autotune.trial.measure`): the configured DataLoader,
the copy to the device, the tuned model, and here also the outputs' copy back, each step inside
a ``record_function`` range named for its stage (``autotune::forward`` ...). The profiler's
schedule skips one step, warms up on one and records the next few, as many as fit in half a
second unprofiled (2 to 20), so the cost stays bounded whatever the model. A model that runs through
ONNX Runtime is profiled by ONNX Runtime too (``enable_profiling``): its nodes are the operators.

Nothing here is timed for a figure the run reports: profiling adds its own overhead.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from autotune.samples import batch_size_of, call_model, outputs_to_cpu, to_device
from autotune.trial.build import settings_active
from autotune.trial.measure import _sync, timing_batches
from autotune.trial.opfamily import STAGES, TRAIN_STAGES, summarize

__all__ = ["RANGE_PREFIX", "profile_state", "profile_training"]

RANGE_PREFIX = "autotune::"
_WAIT, _WARMUP = 1, 1
# Ranges, not operators: the stages', the schedule's steps, the DataLoader's iteration.
_RANGES = (RANGE_PREFIX, "ProfilerStep", "enumerate(DataLoader)")


# Kineto, the profiler's C++ side, writes a line to stderr at every start and stop of a recording
# ("USDT:<date> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start"), at its
# highest log level: KINETO_LOG_LEVEL cannot drop them without dropping its errors as well.
_MARKER = re.compile(rb"USDT:[^\n]*\] profiler_(start|stop)\r?\n?")


@contextlib.contextmanager
def markers_dropped() -> Iterator[None]:
    """Around one call into the profiler (no user code runs in it): what it writes to stderr is
    held, then written on without Kineto's start/stop markers, so any other line, an error
    included, still shows. Where there is no stderr to hold, nothing is filtered.

    Example:
        >>> with markers_dropped():
        ...     _ = os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = _MARKER.sub(b"", held.read())
            if kept:
                os.write(2, kept)


# Seconds of unprofiled steps the recorded window holds: enough for a stable operator table,
# short enough that profiling costs a run a few seconds (the profiler slows each step).
_ACTIVE_S = 0.5


def _active_steps(step: Callable[[], int], target_s: float) -> int:
    """Run two steps unprofiled (the first compiles, loads workers) and return how many
    recorded steps fit in ``target_s`` (2 to 20)."""
    step()
    start = time.perf_counter()
    step()
    per_step = max(time.perf_counter() - start, 1e-6)
    return max(2, min(20, round(target_s / per_step)))


def _op_rows(prof: Any, cuda: bool) -> list[dict[str, Any]]:
    """One row per operator of the recorded steps: its self time (device time on a GPU), calls
    and the input shapes of its most expensive call signature."""
    from torch.autograd import DeviceType

    rows: dict[str, dict[str, Any]] = {}
    heaviest: dict[str, float] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.device_type != DeviceType.CPU:
            continue  # kernels count in the operator that launched them
        if getattr(e, "is_user_annotation", False) or e.key.startswith(_RANGES):
            continue  # ranges (the stages', the DataLoader's) are not operators
        self_us = float(e.self_device_time_total if cuda else e.self_cpu_time_total)
        row = rows.setdefault(e.key, {"name": e.key, "self_us": 0.0, "calls": 0, "input_shapes": ""})
        row["self_us"] += self_us
        row["calls"] += int(e.count)
        if self_us > heaviest.get(e.key, -1.0):
            heaviest[e.key] = self_us
            row["input_shapes"] = str([list(s) for s in (e.input_shapes or []) if s])
    return list(rows.values())


def _stage_us(prof: Any, names: tuple[str, ...]) -> dict[str, float]:
    # On CUDA each range has a device-side twin of the same name with no CPU time: only the
    # CPU-side entry holds the stage's time.
    from torch.autograd import DeviceType

    spans: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith(RANGE_PREFIX) and e.device_type == DeviceType.CPU:
            spans[e.key] = spans.get(e.key, 0.0) + float(e.cpu_time_total)
    return {n: spans.get(RANGE_PREFIX + n, 0.0) for n in names}


def _window(
    step: Callable[[], int], device: torch.device, trace: Path, names: tuple[str, ...], model: Any, n_warm: int = 0
) -> dict:
    """Profile ``step`` (which returns the samples it processed) on a wait/warmup/active schedule
    and write the Chrome trace to ``trace`` (gzipped when it ends in ``.gz``). ``n_warm`` steps
    run unprofiled first: an epoch whose batches differ in shape, so that what is profiled is
    the pipeline in use, not torch.compile compiling each shape, as the timing does."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from autotune.trial.measure import _compiled_frames

    started = time.perf_counter()
    for _ in range(n_warm):
        step()
    n_active = _active_steps(step, _ACTIVE_S)
    from autotune.runtimes import REGISTRY as RUNTIMES

    scratch = Path(tempfile.mkdtemp(prefix="autotune-runtime-profile-"))
    # A runtime's own sessions that the PyTorch profiler cannot see into record their nodes.
    recording = [(rt, sessions) for rt in RUNTIMES.values() if (sessions := rt.profiling(model, scratch))]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    frames = _compiled_frames()
    n_samples = 0
    try:
        prof = profile(
            activities=activities,
            schedule=schedule(wait=_WAIT, warmup=_WARMUP, active=n_active, repeat=1),
            record_shapes=True,
            profile_memory=True,
        )
        # The profiler's own calls, not the steps, inside markers_dropped: the pipeline's output
        # (a DataLoader worker's error) goes straight to stderr, as it comes.
        with markers_dropped():
            prof.__enter__()
        try:
            for i in range(_WAIT + _WARMUP + n_active):
                done = step()
                n_samples += done if i >= _WAIT + _WARMUP else 0
                with markers_dropped():
                    prof.step()
        finally:
            with markers_dropped():
                prof.__exit__(None, None, None)
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        rows = _op_rows(prof, device.type == "cuda")
        shipped = {}
        for rt, sessions in recording:
            got, files = rt.profiled(sessions, n_active)
            rows += got
            if files:  # the runtime's own trace, in the same format: shipped beside the PyTorch one
                path = trace.with_name(trace.name.replace(".json.gz", "") + f"-{rt.name}.json.gz")
                with open(files[0], "rb") as src, gzip.open(path, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                shipped[rt.name] = path.name
        summary = summarize(rows, _stage_us(prof, names), n_steps=n_active, n_samples=n_samples)
    finally:
        for rt, sessions in recording:
            rt.unprofile(sessions)
        shutil.rmtree(scratch, ignore_errors=True)
    summary.update(
        trace=trace.name,
        runtime=recording[0][0].name if recording else "torch",
        time_basis="device (kernel) time" if device.type == "cuda" else "CPU time",
        recompiles=_compiled_frames() - frames,
        profile_s=time.perf_counter() - started,
    )
    if shipped:
        summary["runtime_trace"] = next(iter(shipped.values()))
    return summary


def profile_state(state: Any, dataset: Any, trace: str | Path, *, seed: int = 0) -> dict[str, Any]:
    """Profile a built inference configuration over ``dataset`` and write its trace.

    Args:
        state: A :class:`~autotune.knobs.state.BuildState`.
        dataset: The samples its DataLoader reads.
        trace: Where the Chrome trace goes (``.json.gz``: gzipped).
        seed: Which shuffled order token sequences are read in (as for measurement).

    Returns:
        :func:`~autotune.trial.opfamily.summarize`'s summary, with ``trace`` (its file name),
        ``runtime``, ``time_basis``, ``recompiles`` and ``profile_s`` (what profiling cost).

    Example:
        >>> import tempfile, torch
        >>> from autotune.config import Config
        >>> from autotune.trial.build import build
        >>> state = build(torch.nn.Linear(8, 2), Config(batch_size=4), "cpu")
        >>> s = profile_state(state, [torch.randn(8)] * 64, Path(tempfile.mkdtemp()) / "t.json.gz")
        >>> s["operators"][0]["name"], sorted(s["stages"])[0]
        ('aten::addmm', 'forward')
    """
    device = torch.device(state.device)
    batches, n_warm = timing_batches(dataset, state, 0, seed)

    def step() -> int:
        with torch.profiler.record_function(RANGE_PREFIX + "loader_wait"):
            batch = next(batches)
        with torch.profiler.record_function(RANGE_PREFIX + "host_to_device"):
            on_device = to_device(batch, device, non_blocking=state.non_blocking)
        with torch.profiler.record_function(RANGE_PREFIX + "forward"):
            out = call_model(state.model, on_device)
        with torch.profiler.record_function(RANGE_PREFIX + "output_sync"):
            outputs_to_cpu(out)
            _sync(device)
        return batch_size_of(batch)

    try:
        with settings_active(state.settings), torch.inference_mode():
            return _window(step, device, Path(trace), STAGES, state.model, n_warm)
    finally:
        batches.close()  # shuts down the loader's workers


def profile_training(setup: Any, batches: Iterator[Any], loss_fn: Any, trace: str | Path) -> dict[str, Any]:
    """Profile whole optimizer steps of a :class:`~autotune.trial.train_setup.TrainingSetup`:
    the same step as :meth:`~autotune.trial.train_setup.TrainingSetup.step`, with the loader,
    copy, forward (with the loss), backward and optimizer step in their own ranges."""
    device = torch.device(setup.device)

    def step() -> int:
        for _ in range(setup.accumulation_steps):
            with torch.profiler.record_function(RANGE_PREFIX + "loader_wait"):
                batch = next(batches)
            with torch.profiler.record_function(RANGE_PREFIX + "host_to_device"):
                batch = setup.to_device(batch)
            with torch.profiler.record_function(RANGE_PREFIX + "forward"), setup.autocast():
                loss = loss_fn(call_model(setup.model, batch), batch).float().reshape(()) / setup.accumulation_steps
            with torch.profiler.record_function(RANGE_PREFIX + "backward"):
                setup.scaler.scale(loss).backward()
        with torch.profiler.record_function(RANGE_PREFIX + "optimizer_step"):
            setup.scaler.step(setup.optimizer)
            setup.scaler.update()
            setup.optimizer.zero_grad(set_to_none=True)
            _sync(device)
        return setup.effective_batch_size

    with settings_active(setup.settings):
        return _window(step, device, Path(trace), TRAIN_STAGES, setup.model)
