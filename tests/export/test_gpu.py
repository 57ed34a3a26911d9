"""ONNX Runtime on CUDA: the CUDA provider, I/O binding and the float16 graph (run on a CUDA machine).

The tests of the CUDA execution provider skip, with ONNX Runtime's reason, where no session gets
it (the CPU build of onnxruntime, or a GPU build whose CUDA libraries do not load): ONNX Runtime
would run them on the CPU without a word, and they would pass without testing the provider.
"""

import json

import pytest
import torch
from torch.utils.data import default_collate

import autotune
from autotune.export.onnx import OrtModule, export_onnx, to_fp16
from autotune.export.ort import CUDA_PROVIDER, provider_problem
from tests.models import TinyCNN, image_data

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_provider():
    """Skip where no ONNX Runtime session gets the CUDA execution provider here."""
    why = provider_problem(CUDA_PROVIDER)
    if why is not None:
        pytest.skip(f"ONNX Runtime's CUDA execution provider is absent here: {why}")


@pytest.mark.parametrize("io_binding", [False, True])
def test_cuda_provider_matches_torch(tmp_path, io_binding, cuda_provider):
    model = TinyCNN().eval().cuda()
    batch = default_collate(image_data(16))
    info = export_onnx(model, (batch[0].cuda(), batch[1].cuda()), tmp_path / "model.onnx")
    runner = OrtModule(
        tmp_path / "model.onnx",
        info["input_names"],
        info["output_names"],
        provider="CUDAExecutionProvider",
        io_binding=io_binding,
    )
    x = batch[0].cuda()
    out = runner(x)
    assert runner.session.get_providers()[0] == CUDA_PROVIDER  # no silent fallback to the CPU
    assert out.device.type == "cuda"
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-3, atol=1e-4)


def test_float16_graph_keeps_float32_io_and_stays_close(tmp_path, cuda_provider):
    model = TinyCNN().eval().cuda()
    batch = default_collate(image_data(16))
    info = export_onnx(model, (batch[0].cuda(), batch[1].cuda()), tmp_path / "model.onnx")
    to_fp16(tmp_path / "model.onnx", tmp_path / "model.fp16.onnx")
    runner = OrtModule(
        tmp_path / "model.fp16.onnx", info["input_names"], info["output_names"], provider="CUDAExecutionProvider"
    )
    x = batch[0].cuda()
    out = runner(x)
    assert runner.session.get_providers()[0] == CUDA_PROVIDER
    assert out.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)


def test_onnxruntime_competes_on_cuda(tmp_path, cuda_provider):
    space = {"base": None, "runtime": "all", "ort_precision": "all", "ort_io_binding": "all"}
    result = autotune.optimize(
        TinyCNN(),
        image_data(512),
        space=space,
        fix={"ort_provider": CUDA_PROVIDER},
        device="cuda",
        out_dir=tmp_path,
        n_trials=8,
        measure={"n_windows": 2, "window_s": 0.1, "warmup_batches": 2},
        n_verify_pairs=2,
    )
    ort = [t.user_attrs for t in result.study.trials if t.user_attrs["config"]["runtime"] == "onnxruntime"]
    ok = [a for a in ort if a["status"] == "ok"]
    assert ok, [a.get("reason") for a in ort]
    # Measured on the CUDA provider itself (the session's get_providers()[0]), not on a silent
    # fallback to the CPU.
    assert {a["ort_provider_ran"] for a in ok} == {CUDA_PROVIDER}
    assert set(result.artifacts) == {"onnx", "torchscript"}
    saved = json.loads((tmp_path / "best_config.json").read_text())["artifacts"]
    assert saved["onnx"]["ort"]["provider"] == CUDA_PROVIDER
    served = autotune.load(tmp_path, format="onnx", device="cuda")
    assert served.module.provider_ran == CUDA_PROVIDER


@pytest.mark.parametrize("runtime", ["torchscript", "onnxruntime"])
def test_runtime_candidates_of_a_cuda_model_export_and_run(runtime):
    # The example is kept on the CPU; the exporters must get it on the model's device.
    from autotune.config import Config
    from autotune.knobs.state import BuildExtras
    from autotune.trial.build import build

    batch = default_collate(image_data(8))
    state = build(TinyCNN(), Config({"runtime": runtime}), "cuda", extras=BuildExtras(example=batch))
    assert state.runtime == runtime
    x = batch[0].cuda()
    out = state.model(x)
    assert out.device.type == "cuda" and out.shape == (8, 4)
