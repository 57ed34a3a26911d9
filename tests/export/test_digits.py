"""The digits CNN of examples/digits.py, exported: ONNX that runs without torch, INT8 QDQ at
under 30% of the float file with its real accuracy drop, and TorchScript."""

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import autotune
from autotune.export.onnx import OrtModule, export_onnx, quantize_onnx
from autotune.export.parity import check_parity
from tests.export.test_onnx import _run_without_torch


@pytest.fixture(scope="module")
def digits():
    return autotune.load_config("examples/digits.py")


def _accuracy(outputs, batch):
    return (outputs.argmax(1) == batch[1]).float().mean().item()


def test_digits_onnx_runs_without_torch_and_its_int8_form_is_under_30_percent(digits, tmp_path):
    model, test = digits["model"].eval(), digits["test_dataset"]
    info = export_onnx(model, default_collate(test[:8]), tmp_path / "model.onnx")
    x = np.stack([s[0].numpy() for s in test[:37]])
    (out,) = _run_without_torch(tmp_path / "model.onnx", tmp_path, [{"input_0": x}])
    with torch.no_grad():
        np.testing.assert_allclose(out, model(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-4)

    calibration = [default_collate(digits["dataset"][i : i + 32]) for i in range(0, 256, 32)]
    q = quantize_onnx(info["path"], tmp_path / "int8.onnx", "int8_static", calibration)
    assert q["bytes"] <= 0.30 * q["src_bytes"]
    runner = OrtModule(q["path"], info["input_names"], info["output_names"])
    baseline = np.mean([_accuracy(model(s[0][None]), (None, s[1][None])) for s in test])
    parity = check_parity(runner, model, test, 32, metric=_accuracy, baseline_metric=float(baseline), rtol_l2=0.1)
    assert parity["metric"] is not None and parity["metric_drop"] is not None  # recorded, on held-out digits
    assert parity["metric_drop"] <= 0.02, parity
