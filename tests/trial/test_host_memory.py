"""A trial whose batches in flight (loader workers x prefetch, pinned copies, the feeder's) would
not fit the host's shared or available memory is not started, and says why."""

import pytest
import torch

from autotune.config import Config
from autotune.errors import TrialError
from autotune.trial.inprocess import InProcessRunner
from autotune.trial.measure import MeasureSettings
from autotune.trial.memory import check_host_memory, in_flight
from autotune.trial.spec import WorkerSpec

MIB = 2**20


def test_the_bytes_in_flight_count_workers_prefetch_pinning_and_the_feeder():
    batch = 100 * MIB
    assert in_flight({"num_workers": 0}, batch) == (0, batch)
    assert in_flight({"num_workers": 4, "prefetch_factor": 8}, batch) == (32 * batch, 33 * batch)
    pinned = in_flight({"num_workers": 4, "prefetch_factor": 8, "pin_memory": True, "feed_ahead": 2}, batch)
    assert pinned == (32 * batch, (32 + 33 + 2 + 1) * batch)
    # On the device nothing waits in host memory but the batch being read.
    assert in_flight({"num_workers": 8, "pin_memory": True, "device_resident": True}, batch) == (0, batch)


def test_a_configuration_that_would_fill_shared_memory_is_refused_with_its_reason():
    config = {"num_workers": 8, "prefetch_factor": 8, "pin_memory": False}
    batch = 154 * MIB  # batch 256 of 224x224 float images
    with pytest.raises(TrialError, match=r"8 loader workers x 8 batches ahead take about 9.6 GiB of shared memory, and "
                       r"/dev/shm has 8.0 GiB free") as raised:  # fmt: skip
        check_host_memory(config, batch, shm_free=8 * 2**30, available=100 * 2**30)
    assert raised.value.kind == "oom"
    check_host_memory(config, batch, shm_free=64 * 2**30, available=100 * 2**30)  # fits
    with pytest.raises(TrialError, match="host memory"):
        check_host_memory({**config, "pin_memory": True}, batch, shm_free=64 * 2**30, available=20 * 2**30)


class _Mean(torch.nn.Module):
    def forward(self, x):
        return x.mean(dim=(1, 2), keepdim=False)[:, None]


def test_the_trial_is_not_started_and_the_runner_goes_on():
    big = torch.zeros(1024, 4096)  # 16 MiB a sample, one tensor shared by every sample
    spec = WorkerSpec(
        model=_Mean(),
        dataset=[big] * 16,
        metric=None,
        device="cpu",
        baseline=dict(Config({"batch_size": 8})),
        val_indices=list(range(8)),
        measure=MeasureSettings(n_windows=2, window_s=0.03, warmup_batches=1),
    )
    runner = InProcessRunner(spec)
    # 16 workers x 8 batches of 1,024 samples x 16 MiB: 2 TiB in flight, on no machine.
    huge = dict(Config({"batch_size": 1024, "num_workers": 16, "prefetch_factor": 8}))
    result = runner.run(huge, timeout=60.0)
    assert result.status == result.kind == "oom" and "not started" in result.reason, result.reason
    assert runner.run(dict(Config({"batch_size": 8})), timeout=60.0).status == "ok"
