import shutil

import pytest
import torch

import autotune
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from tests.models import TinyCNN


def test_cuda_graph_modes_are_not_offered_on_cpu(cpu_env):
    offer = get_knob("compile_mode").offer(SpaceContext(cpu_env, describe([torch.zeros(4)]), 32))
    assert "reduce-overhead" not in offer.values and "max-autotune" not in offer.values
    assert "CUDA graphs" in offer.excluded["reduce-overhead"]
    assert ("default" in offer.values) == (cpu_env.compiler is not None)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")
def test_compiled_model_matches_eager():
    model = TinyCNN().eval()
    x = torch.randn(4, 3, 8, 8)
    tuned = autotune.apply(model, {"compile_mode": "default"}, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x), atol=1e-4, rtol=1e-4)
    assert hasattr(tuned, "_orig_mod")  # really compiled


@pytest.mark.gpu
def test_cuda_graph_modes_run_on_cuda():
    model = TinyCNN().eval()
    x = torch.randn(4, 3, 8, 8, device="cuda")
    tuned = autotune.apply(model, {"compile_mode": "reduce-overhead"}, device="cuda")
    with torch.no_grad():
        for _ in range(3):  # warm-up runs record the CUDA graph
            out = tuned(x)
        torch.testing.assert_close(out, model.cuda()(x), atol=1e-3, rtol=1e-3)
