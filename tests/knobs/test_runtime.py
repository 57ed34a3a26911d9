import pytest
import torch

from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from autotune.trial.build import settings_active


def test_threads_up_to_torch_default(cpu_env):
    offer = get_knob("num_threads").offer(SpaceContext(cpu_env, describe([torch.zeros(4)]), 32))
    assert max(offer.values) == cpu_env.cpu_threads and 1 in offer.values


def test_settings_are_active_only_inside_the_block():
    before = torch.get_num_threads()
    with settings_active({"num_threads": 1}):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_cuda_settings_are_not_offered_on_cpu(cpu_env):
    ctx = SpaceContext(cpu_env, describe([torch.zeros(4)]), 32)
    for name in ("cudnn_benchmark", "tf32"):
        offer = get_knob(name).offer(ctx)
        assert offer.values == [False] and "CUDA" in offer.excluded["true"]


@pytest.mark.gpu
def test_cuda_settings_take_effect():
    from autotune._pristine import tf32_on

    with settings_active({"cudnn_benchmark": True, "tf32": True}):
        assert torch.backends.cudnn.benchmark and tf32_on()
    assert not tf32_on()
