"""ONNX export, INT8/float16 variants and OrtModule, checked with real onnxruntime; the exported
graphs also run in a fresh process that imports only onnxruntime and numpy."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from autotune.data import model_inputs
from autotune.errors import ConfigError, ExportError
from autotune.export.onnx import OrtModule, export_onnx, quantize_onnx, to_fp16
from autotune.export.parity import check_parity
from tests.models import ItemBranch


class ConvNet(nn.Module):
    """(1, 8, 8) images to 10 classes; big enough that weights dominate the file (~0.8 MB)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(1, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.head = nn.Sequential(nn.Linear(128 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Encoder(nn.Module):
    """Token ids (B, 16) and a padding mask (B, 16) to 3 classes; its two layers start as copies,
    so the exported graph shares their weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=mask).mean(1))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


@torch.library.custom_op("autotune_test_onnx::shift", mutates_args=())
def _shift(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@_shift.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CustomOp(nn.Module):
    """Calls an operator neither ONNX exporter can translate."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _shift(self.linear(x))


def _image_samples(model: nn.Module, n: int = 48) -> list:
    """Images labelled with the float model's own prediction, so accuracy is top-1 agreement."""
    images = torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        labels = model(images).argmax(1)
    return list(zip(images, labels, strict=True))


def _token_samples(n: int = 16) -> list:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (n, 16), generator=gen)
    lengths = torch.randint(8, 17, (n,), generator=gen)
    mask = torch.arange(16)[None, :] >= lengths[:, None]  # True marks padding
    return [{"ids": ids[i], "mask": mask[i], "label": torch.tensor(0)} for i in range(n)]


def _sequence_samples(n: int = 16) -> list:
    x = torch.randn(n, 10, 8, generator=torch.Generator().manual_seed(0))
    return [(x[i], torch.tensor(0)) for i in range(n)]


def _accuracy(outputs: torch.Tensor, batch: tuple) -> float:
    return float((outputs.argmax(1) == batch[1]).float().mean())


# Runs the graph on saved inputs with nothing but onnxruntime and numpy, as a deployment would.
_RUN_ORT = """
import json, sys
import numpy as np
import onnxruntime as ort
model, folder, names, n_runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
for i in range(n_runs):
    feeds = {name: np.load(f"{folder}/in_{i}_{name}.npy") for name in names}
    np.save(f"{folder}/out_{i}.npy", session.run(None, feeds)[0])
if "torch" in sys.modules:
    sys.exit("torch was imported")
"""


def _run_without_torch(model_path, folder, feeds_per_run: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    names = list(feeds_per_run[0])
    for i, feeds in enumerate(feeds_per_run):
        for name, array in feeds.items():
            np.save(folder / f"in_{i}_{name}.npy", array)
    argv = [sys.executable, "-c", _RUN_ORT, str(model_path), str(folder), json.dumps(names), str(len(feeds_per_run))]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [np.load(folder / f"out_{i}.npy") for i in range(len(feeds_per_run))]


CASES = {
    "cnn": (ConvNet, lambda: _image_samples(ConvNet().eval(), 16), ["input_0"]),
    "transformer": (Encoder, _token_samples, ["ids", "mask"]),
    "lstm": (LSTMClassifier, _sequence_samples, ["input_0"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_graph_runs_without_torch_at_any_batch_size(case, tmp_path):
    model_cls, make_samples, input_names = CASES[case]
    model, samples = model_cls().eval(), make_samples()
    info = export_onnx(model, default_collate(samples[:4]), tmp_path / "model.onnx")
    assert info["exporter"] == "dynamo" and info["fallback_reason"] is None
    assert info["simplified"]  # onnxslim on the exporter's own shapes, its outputs checked
    assert info["input_names"] == input_names and info["opset"] >= 17
    graph = onnx.load(str(tmp_path / "model.onnx")).graph
    assert all(not v.type.tensor_type.shape.dim[0].HasField("dim_value") for v in [*graph.input, *graph.output])

    runs = [default_collate(samples[:3]), default_collate(samples[3:10])]  # batches of 3 and 7
    inputs = [model_inputs(batch) for batch in runs]
    feeds = [{n: t.numpy() for n, t in zip(input_names, [*a, *k.values()], strict=True)} for a, k in inputs]
    outputs = _run_without_torch(tmp_path / "model.onnx", tmp_path, feeds)
    for (args, kwargs), out in zip(inputs, outputs, strict=True):
        with torch.no_grad():
            expected = model(*args, **kwargs)
        assert out.shape == tuple(expected.shape)
        np.testing.assert_allclose(out, expected.numpy(), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def convnet_onnx(tmp_path_factory):
    model = ConvNet().eval()
    samples = _image_samples(model)
    path = tmp_path_factory.mktemp("convnet") / "model.onnx"
    info = export_onnx(model, default_collate(samples[:8]), path)
    return model, samples, info


def test_static_int8_is_under_a_third_of_the_size_and_keeps_top1(convnet_onnx, tmp_path):
    model, samples, info = convnet_onnx
    calibration = [default_collate(samples[i : i + 8]) for i in range(0, 32, 8)]
    q = quantize_onnx(info["path"], tmp_path / "int8.onnx", "int8_static", calibration)
    assert q["quant_format"] == "QDQ" and q["bytes"] <= 0.30 * q["src_bytes"]
    runner = OrtModule(q["path"], info["input_names"], info["output_names"], intra_op_threads=1)
    parity = check_parity(
        runner, model, samples, 8, metric=_accuracy, baseline_metric=1.0, rtol_l2=0.1, kinds=["logits"]
    )
    assert parity["fidelity"] >= 0.8  # top-1 agreement with the float model, and probabilities
    assert 0.0 <= parity["metric_drop"] <= 0.2
    assert parity["rel_l2"] is not None and parity["rel_l2"] < 0.1


def test_dynamic_int8_survives_weights_shared_between_layers(tmp_path):
    # ONNX Runtime's quantizer transposes a weight two Gemms share twice unless untied first.
    model, samples = Encoder().eval(), _token_samples()
    info = export_onnx(model, default_collate(samples[:4]), tmp_path / "model.onnx")
    q = quantize_onnx(info["path"], tmp_path / "int8.onnx", "int8_dynamic", [])
    runner = OrtModule(q["path"], info["input_names"], info["output_names"], intra_op_threads=1)
    # Each output is judged against its own scale; a doubly transposed weight is off by more than 100%.
    parity = check_parity(runner, model, samples, 8, rtol_l2=0.5)
    assert parity["ok"], parity["reason"]


def test_fp16_keeps_float32_inputs_and_outputs(convnet_onnx, tmp_path):
    model, samples, info = convnet_onnx
    half = to_fp16(info["path"], tmp_path / "fp16.onnx")
    graph = onnx.load(half["path"]).graph
    assert {v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]} == {onnx.TensorProto.FLOAT}
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.initializer)
    assert half["bytes"] < 0.6 * half["src_bytes"]
    runner = OrtModule(half["path"], info["input_names"], info["output_names"], intra_op_threads=1)
    assert check_parity(runner, model, samples[:16], 8, rtol_l2=1e-2)["ok"]


def test_parity_fails_against_a_perturbed_reference(convnet_onnx):
    model, samples, info = convnet_onnx
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    runner = OrtModule(info["path"], info["input_names"], info["output_names"], intra_op_threads=1)
    assert check_parity(runner, model, samples[:16], 8)["ok"]
    parity = check_parity(runner, perturbed, samples[:16], 8)
    assert not parity["ok"] and "relative L2 error" in parity["reason"]


def test_ort_module_pickles_and_rebuilds_its_session(convnet_onnx):
    _, samples, info = convnet_onnx
    runner = OrtModule(info["path"], info["input_names"], info["output_names"], graph_optimization="basic")
    x = torch.stack([s[0] for s in samples[:5]])
    first = runner(x)
    clone = pickle.loads(pickle.dumps(runner))
    torch.testing.assert_close(clone(input_0=x), first)
    bound = OrtModule(info["path"], info["input_names"], info["output_names"], io_binding=True, intra_op_threads=1)
    torch.testing.assert_close(bound(x), first)  # the torch tensors' memory bound in place
    with pytest.raises(ConfigError, match="Known: disable, basic, extended, all"):
        OrtModule(info["path"], ["input_0"], ["output"], graph_optimization="max")


def test_dynamo_failure_falls_back_to_the_torchscript_exporter(tmp_path):
    info = export_onnx(ItemBranch().eval(), torch.ones(2, 4), tmp_path / "model.onnx")
    assert info["exporter"] == "torchscript"
    assert "data-dependent" in info["fallback_reason"] and "\n" not in info["fallback_reason"]


def test_both_exporters_failing_raise_one_line_export_error(tmp_path):
    with pytest.raises(ExportError, match="Neither ONNX exporter") as caught:
        export_onnx(CustomOp().eval(), torch.ones(2, 4), tmp_path / "model.onnx")
    assert "autotune_test_onnx" in str(caught.value) and "\n" not in str(caught.value)
    assert not list(tmp_path.iterdir())
