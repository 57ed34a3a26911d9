import pytest
import torch

import autotune
from autotune.config import Config
from autotune.data import describe, to_device
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.state import unwrap
from autotune.trial.build import build, make_loader
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


class Bytes(torch.nn.Module):
    """A CNN over uint8 images: the cast to float is the model's own first step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyCNN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float() / 255)


def _uint8_images(n: int = 16) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=gen), torch.arange(n)
    )


@pytest.mark.parametrize("gather", ["per_sample", "batched"])
def test_batches_leave_the_loader_as_the_samples_are_and_convert_inside_forward(gather):
    # Casts and layout changes belong on the device, after the copy: the loader hands over the
    # samples' own dtype and layout (uint8 crosses the bus as 1 byte a pixel, not 4), and the
    # tuned model converts its inputs inside its forward.
    config = Config({"batch_size": 8, "channels_last": True, "amp_dtype": "bfloat16", "gather": gather})
    floats = torch.utils.data.TensorDataset(torch.randn(16, 3, 8, 8), torch.arange(16))
    state = build(TinyCNN(), config, "cpu")
    x, _ = next(iter(make_loader(floats, state)))
    assert x.dtype == torch.float32 and x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    seen = []
    unwrap(state.model).conv.register_forward_pre_hook(
        lambda m, i: seen.append((i[0].dtype, i[0].is_contiguous(memory_format=torch.channels_last)))
    )
    state.model(to_device(x, torch.device(state.device)))
    assert seen == [(torch.float32, True)]  # channels-last inside forward; autocast casts inside the conv

    state = build(Bytes(), config, "cpu")
    x, _ = next(iter(make_loader(_uint8_images(), state)))
    assert x.dtype == torch.uint8
    inputs = []
    unwrap(state.model).register_forward_pre_hook(lambda m, i: inputs.append(i[0].dtype))
    assert state.model(to_device(x, torch.device(state.device))).dtype == torch.float32
    assert inputs == [torch.uint8]


@pytest.mark.gpu
def test_uint8_batches_cross_to_the_gpu_as_uint8(monkeypatch):
    import autotune.knobs.prefetch as prefetch

    copied = []

    def spy(batch, device, non_blocking=False):
        copied.append(batch[0].dtype)
        return to_device(batch, device, non_blocking=non_blocking)

    monkeypatch.setattr(prefetch, "to_device", spy)
    values = {"batch_size": 8, "channels_last": True, "amp_dtype": "float16", "pin_memory": True}
    state = build(Bytes(), Config({**values, "gather": "batched", "device_prefetch": True}), "cuda:0")
    with torch.inference_mode():
        for x, _ in make_loader(_uint8_images(), state):
            assert x.is_cuda and x.dtype == torch.uint8  # on the device, still 1 byte a pixel
            assert state.model(x).dtype == torch.float32
    assert copied == [torch.uint8, torch.uint8]  # what crossed the bus
