"""Which ONNX Runtime provider a session really runs on, and the records that name it.

ONNX Runtime lists a provider its build has whether or not the provider's libraries load; a
session asked for one that does not load runs on the CPU without raising. These tests run the
real onnxruntime of this machine, which has no GPU: whether its build lists the CUDA provider
(the GPU build, here) or not (the CPU build), a session asked for CUDA runs on the CPU, and every
record must say so.
"""

import types
import warnings

import onnxruntime
import pytest
import torch
from torch.utils.data import default_collate

from autotune.export.ort import CPU_PROVIDER, CUDA_PROVIDER, OrtModule, provider_for, provider_problem
from tests.models import MLP, classification_data

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")


def test_a_provider_no_session_gets_here_is_named_with_the_reason():
    why = provider_problem(CUDA_PROVIDER)
    assert why is not None
    if CUDA_PROVIDER in onnxruntime.get_available_providers():  # the GPU build: listed, but cannot load
        assert "ran on CPUExecutionProvider" in why
    else:
        assert "not in this onnxruntime build" in why
    assert provider_problem(CPU_PROVIDER) is None
    assert provider_for("cuda") == provider_for("cuda:0", "TensorrtExecutionProvider") == CPU_PROVIDER
    assert provider_for("cpu") == CPU_PROVIDER


def test_a_session_asked_for_cuda_says_it_ran_on_the_cpu(tmp_path):
    from autotune.export.onnx import export_onnx

    x = default_collate(classification_data(8))[0]
    info = export_onnx(MLP().eval(), x, tmp_path / "model.onnx")
    if CUDA_PROVIDER not in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime build does not list the CUDA provider: OrtModule refuses it outright")
    runner = OrtModule(tmp_path / "model.onnx", info["input_names"], info["output_names"], provider=CUDA_PROVIDER)
    assert runner(x).shape == (8, 4)
    assert runner.provider == CUDA_PROVIDER and runner.provider_ran == CPU_PROVIDER


def test_the_onnx_check_of_a_cuda_model_records_the_provider_that_ran(tmp_path):
    from autotune.runtimes.base import get_runtime

    model = MLP().eval()
    example = default_collate(classification_data(8))
    path = tmp_path / "model.onnx"
    info, run = get_runtime("onnxruntime").export(
        model, example, path, device="cuda:0", fallback=None, source=None, spatial=False
    )
    assert info["ort"]["provider"] == CPU_PROVIDER
    with torch.no_grad():
        torch.testing.assert_close(run(example[0]), model(example[0]), rtol=1e-4, atol=1e-5)


class _Runner:
    """The worker's side of ``export_winner``: what a worker's export returns (a real export needs
    a CUDA model, which this machine cannot hold)."""

    def call(self, method, config, out, formats, n_trials):
        assert method == "export"
        return {"artifacts": {fmt: {"status": "ok"} for fmt in formats}}


def test_the_winners_onnx_record_names_the_provider_a_session_gets_on_the_runs_device(tmp_path):
    from autotune.config import Config
    from autotune.run.finish import export_winner

    env = types.SimpleNamespace(device="cuda:0", is_cuda=True)  # a run tuned on CUDA
    best = {"config": Config({}).to_dict()}
    artifacts = export_winner(_Runner(), best, tmp_path, ("onnx", "torchscript"), env)
    assert artifacts["onnx"]["ort"]["provider"] == CPU_PROVIDER
    assert "ort" not in artifacts["torchscript"]


def test_an_artifact_loaded_on_cuda_without_a_cuda_provider_says_it_runs_on_the_cpu(tmp_path):
    from autotune.deploy.load import _open
    from autotune.runtimes.artifacts import export_artifacts

    samples = classification_data(16)
    records = export_artifacts(MLP().eval(), default_collate(samples[:8]), samples, 8, tmp_path, ["onnx"])
    record = {**records["onnx"], "ort": {"provider": CUDA_PROVIDER, "graph_optimization": "all"}}
    with pytest.warns(UserWarning, match="runs on ONNX Runtime's CPU provider"):
        module = _open("onnx", tmp_path / "model.onnx", record, "cuda")
    assert module.provider == CPU_PROVIDER and not module.io_binding
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on the CPU, as recorded for it: nothing to warn about
        module = _open("onnx", tmp_path / "model.onnx", {**record, "ort": {"provider": CPU_PROVIDER}}, "cpu")
    assert module.provider == CPU_PROVIDER
