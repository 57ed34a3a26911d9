import torch

import autotune
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from tests.models import TinyCNN, image_data


def test_channels_last_only_for_image_inputs(cpu_env):
    flat = get_knob("channels_last").offer(SpaceContext(cpu_env, describe([torch.zeros(4)]), 32))
    assert flat.values == [False] and "4-D" in flat.excluded["true"]
    images = get_knob("channels_last").offer(SpaceContext(cpu_env, describe(image_data()), 32))
    assert images.values == [False, True]


def test_channels_last_converts_weights_and_inputs():
    seen = []
    tuned = autotune.apply(TinyCNN(), {"channels_last": True}, device="cpu")
    tuned.model.conv.register_forward_pre_hook(
        lambda m, i: seen.append(i[0].is_contiguous(memory_format=torch.channels_last))
    )
    tuned(torch.randn(2, 3, 8, 8))
    assert seen == [True]
    assert tuned.model.conv.weight.is_contiguous(memory_format=torch.channels_last)
