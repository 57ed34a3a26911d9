import os

import pytest
import torch

import autotune
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob


@pytest.fixture()
def ctx(cpu_env):
    return SpaceContext(cpu_env, describe([torch.zeros(4)] * 64), 32)


def test_workers_bounded_by_cores(ctx):
    offer = get_knob("num_workers").offer(ctx)
    assert 0 in offer.values and max(offer.values) <= (os.cpu_count() or 1)


def test_worker_options_only_apply_with_workers():
    for name in ("prefetch_factor", "persistent_workers"):
        assert not get_knob(name).applies({"num_workers": 0})
        assert get_knob(name).applies({"num_workers": 2})


def test_pin_memory_is_cuda_only(ctx):
    offer = get_knob("pin_memory").offer(ctx)
    assert offer.values == [False] and "CUDA" in offer.excluded["true"]


def test_tuned_dataloader_uses_every_loader_knob():
    data = [torch.full((2,), float(i)) for i in range(10)]
    loader = autotune.dataloader(
        data, {"batch_size": 4, "num_workers": 1, "prefetch_factor": 4, "persistent_workers": True}
    )
    assert loader.batch_size == 4 and loader.num_workers == 1
    assert loader.prefetch_factor == 4 and loader.persistent_workers
    assert torch.cat(list(loader))[:, 0].tolist() == [float(i) for i in range(10)]  # in order, nothing dropped


def test_workers_bounded_by_the_cpus_this_process_may_use(ctx, monkeypatch):
    # A container's quota or a taskset gives this process fewer CPUs than the machine has.
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr("autotune.env._cpu_quota", lambda root="": 3.0)
    offer = get_knob("num_workers").offer(ctx)
    assert offer.values == [0, 1, 2, 3] and "(3:" in offer.excluded["4"]
