"""Who counts as "another process on the GPU": NVML faked, since this machine may have no GPU."""

import os
import subprocess
import sys
import types

import pytest
import torch

from autotune.trial.measure import GpuSharing, MeasureSettings, is_busy, run_pids


class _NVMLError(Exception):
    pass


class _NotFoundError(_NVMLError):
    pass


def _fake_nvml(monkeypatch, samples=None, error=None):
    """A pynvml whose per-process utilization samples are ``samples`` [(pid, sm%, mem%)], and
    whose running-process list holds every pid in them (all hold a context)."""
    seen = {}

    def utilization(handle, since):
        seen["since"] = since
        if error is not None:
            raise error
        return [types.SimpleNamespace(pid=p, smUtil=sm, memUtil=mem, timeStamp=since + 1) for p, sm, mem in samples]

    fake = types.SimpleNamespace(
        NVMLError=_NVMLError,
        NVMLError_NotFound=_NotFoundError,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: ("gpu", i),
        nvmlDeviceGetProcessUtilization=utilization,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=p) for p, *_ in samples or []],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return seen


def test_the_runs_own_processes_are_never_another_process_on_the_gpu(monkeypatch):
    """On an H100 every trial was marked noisy: "1 other process used the GPU", the user's own
    process, which holds a CUDA context. The user's process (the worker's parent), the worker
    and its siblings are this run."""
    mine = run_pids()
    assert os.getpid() in mine and os.getppid() in mine
    stranger = max(mine) + 100_000  # not a pid of this run
    _fake_nvml(monkeypatch, [(os.getpid(), 90, 40), (os.getppid(), 30, 10), (stranger, 0, 0)])
    probe = GpuSharing(torch.device("cuda", 0))
    probe.start()
    assert probe.stop() == 0  # the stranger holds a context but computed nothing


def test_a_process_outside_the_run_that_computes_during_the_windows_counts(monkeypatch):
    stranger = max(run_pids()) + 100_000
    seen = _fake_nvml(monkeypatch, [(os.getpid(), 90, 40), (stranger, 55, 5)])
    probe = GpuSharing(torch.device("cuda", 0))
    probe.start()
    assert probe.stop() == 1
    assert seen["since"] > 0  # the samples asked for start at the windows, not before
    assert is_busy({"gpu_others": 1}, MeasureSettings())


def test_no_samples_since_the_start_is_nobody_and_no_nvml_is_unknown(monkeypatch):
    _fake_nvml(monkeypatch, [], error=_NotFoundError())
    probe = GpuSharing(torch.device("cuda", 0))
    probe.start()
    assert probe.stop() == 0
    _fake_nvml(monkeypatch, [], error=_NVMLError("not supported"))
    probe = GpuSharing(torch.device("cuda", 0))
    probe.start()
    assert probe.stop() is None
    probe = GpuSharing(torch.device("cpu"))
    probe.start()
    assert probe.stop() is None


def test_a_sibling_worker_of_the_same_run_is_not_another_process():
    """The run's other workers (several GPUs) and loader workers are children of the same parent."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in run_pids()
    finally:
        child.kill()
        child.wait()


@pytest.mark.gpu
def test_on_cuda_the_users_own_context_does_not_make_a_measurement_noisy():
    from autotune.config import Config
    from autotune.trial.build import build
    from autotune.trial.measure import measure
    from tests.models import MLP, classification_data

    torch.zeros(1, device="cuda")  # this process holds a context, as a user's does
    state = build(MLP(), Config({"batch_size": 16}), "cuda")
    result = measure(state, classification_data(128), MeasureSettings(n_windows=2, window_s=0.05))
    assert result["gpu_others"] in (0, None)


def test_samples_from_another_pid_namespace_are_unknown_not_others(monkeypatch):
    """In a container NVML may speak of the host's PIDs: the worker's own samples then carry a
    PID it does not know, and counting them would mark every trial noisy."""
    stranger = max(run_pids()) + 100_000
    _fake_nvml(monkeypatch, [(stranger, 80, 30)])
    probe = GpuSharing(torch.device("cuda", 0))
    probe.start()
    assert probe.stop() is None
