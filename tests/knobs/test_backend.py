"""The ONNX Runtime knobs offer a GPU provider, and I/O binding, only where a session really runs
on it; a trial whose session fell back to another provider is infeasible, never measured under
the name of the provider it asked for.

This machine has no GPU, so a run "on CUDA" is an Env that says so; the onnxruntime that judges
the providers is the real one, and no session it makes here gets the CUDA provider.
"""

import dataclasses

import onnxruntime
import pytest
import torch
from torch.utils.data import default_collate

from autotune.config import Config
from autotune.data import describe
from autotune.errors import TrialError
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.state import BuildExtras
from autotune.trial.build import build
from tests.models import MLP, classification_data

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")


@pytest.fixture
def cuda_ctx(cpu_env):
    """A space built for a run on CUDA, judged by this machine's onnxruntime."""
    return SpaceContext(dataclasses.replace(cpu_env, device="cuda:0"), describe([torch.zeros(4)]), 32)


def test_no_gpu_provider_is_offered_where_no_session_runs_on_it(cuda_ctx):
    offer = get_knob("ort_provider").offer(cuda_ctx)
    assert offer.values == ["CPUExecutionProvider"]
    assert set(offer.excluded) == {"CUDAExecutionProvider", "TensorrtExecutionProvider"}
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():  # listed, yet a session runs on the CPU
        assert "ran on CPUExecutionProvider" in offer.excluded["CUDAExecutionProvider"]


def test_io_binding_is_not_offered_without_a_cuda_provider(cuda_ctx, cpu_env):
    offer = get_knob("ort_io_binding").offer(cuda_ctx)
    assert offer.values == [False] and "CUDAExecutionProvider" in offer.excluded["true"]
    cpu = get_knob("ort_io_binding").offer(SpaceContext(cpu_env, describe([torch.zeros(4)]), 32))
    assert cpu.values == [False]


def test_io_binding_does_not_apply_with_the_cpu_provider():
    knob = get_knob("ort_io_binding")
    assert not knob.applies({"runtime": "onnxruntime", "ort_provider": "CPUExecutionProvider"})
    assert knob.applies({"runtime": "onnxruntime", "ort_provider": "CUDAExecutionProvider"})
    assert not knob.applies({"runtime": "torch", "ort_provider": "CUDAExecutionProvider"})


def test_a_session_that_fell_back_to_the_cpu_makes_the_trial_infeasible():
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime build does not list the CUDA provider, so no session falls back from it")
    extras = BuildExtras(example=default_collate(classification_data(8))[0])
    config = Config({"runtime": "onnxruntime", "ort_provider": "CUDAExecutionProvider"})
    with pytest.raises(TrialError, match="ran the session on CPUExecutionProvider") as raised:
        build(MLP(), config, "cpu", extras=extras)
    assert raised.value.kind == "unsupported"


def test_an_onnxruntime_trial_records_the_provider_that_ran():
    extras = BuildExtras(example=default_collate(classification_data(8))[0])
    state = build(MLP(), Config({"runtime": "onnxruntime"}), "cpu", extras=extras)
    assert state.info["ort_provider_ran"] == "CPUExecutionProvider"
    assert state.artifact["ort"]["provider"] == "CPUExecutionProvider"
