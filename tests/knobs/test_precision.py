import pytest
import torch

import autotune
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob


def test_float16_is_cuda_only_and_bfloat16_follows_the_cpu(cpu_env):
    offer = get_knob("amp_dtype").offer(SpaceContext(cpu_env, describe([torch.zeros(4)]), 32))
    assert "float16" not in offer.values and "CUDA" in offer.excluded["float16"]
    assert ("bfloat16" in offer.values) == cpu_env.bf16


def test_bfloat16_runs_the_matmuls_in_bfloat16_and_returns_float32():
    seen = []
    lin = torch.nn.Linear(8, 8)
    lin.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    fast = autotune.apply(lin, {"amp_dtype": "bfloat16"}, device="cpu")
    out = fast(torch.randn(2, 8))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32


@pytest.mark.gpu
def test_float16_and_bfloat16_on_cuda():
    from autotune.env import Env

    env = Env.detect("cuda")
    offer = get_knob("amp_dtype").offer(SpaceContext(env, describe([torch.zeros(4)]), 32))
    assert "float16" in offer.values
    if torch.cuda.get_device_capability() >= (8, 0):  # Ampere on: bfloat16 tensor cores
        assert "bfloat16" in offer.values
    x = torch.randn(4, 8, device="cuda")
    for dtype in offer.values:
        fast = autotune.apply(torch.nn.Linear(8, 8), {"amp_dtype": dtype}, device="cuda")
        # The dtype the matrix product ran in: the inner Linear's own output, before the
        # wrapper casts the model's outputs back to float32.
        ran = []
        for module in fast.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda m, i, o, ran=ran: ran.append((o.dtype, o.device.type)))
        out = fast(x)
        assert ran == [(getattr(torch, dtype), "cuda")], (dtype, ran)
        assert out.dtype == torch.float32 and out.device.type == "cuda"
