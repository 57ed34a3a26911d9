import torch

from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.state import BuildState


def test_batch_sizes_are_bounded_by_the_dataset(cpu_env):
    data = describe([torch.zeros(4)] * 100)
    offer = get_knob("batch_size").offer(SpaceContext(cpu_env, data, 32))
    assert max(offer.values) <= 100 and 96 in offer.values and 128 not in offer.values
    assert "larger than the dataset (100 samples)" in offer.excluded["128"]


def test_batch_sizes_are_bounded_by_memory(cpu_env):
    big = describe([torch.zeros(1)] * 5000)
    # Pretend one sample is huge relative to memory: only small batches fit under 10%.
    huge = type(big)(
        n_samples=5000, kind="tensor", shapes={}, sample_bytes=cpu_env.device_mem_bytes // 200, image_input=False
    )
    offer = get_knob("batch_size").offer(SpaceContext(cpu_env, huge, 32))
    assert max(offer.values) <= 20 and "of the device's memory" in offer.excluded["32"]


def test_baseline_is_the_users_batch_capped_by_the_dataset(cpu_env):
    knob = get_knob("batch_size")
    assert knob.baseline(SpaceContext(cpu_env, describe([torch.zeros(2)] * 10), 32)) == 10
    state = BuildState(model=None, device="cpu")
    knob.apply(state, 64)
    assert state.batch_size == 64 and state.loader_kwargs["batch_size"] == 64
