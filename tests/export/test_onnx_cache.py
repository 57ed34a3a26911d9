"""ONNX exports come from the run's cache where the same torch model was exported before: every
ONNX Runtime trial at another batch size or thread count, each confirmation worker and the
winner's export ran the dynamo exporter and onnxslim again (5 s of real MiniLM each time)."""

import copy

import numpy as np
import pytest
import torch

from autotune.config import Config
from autotune.export.onnx import export_onnx
from autotune.export.onnx_cache import ONNX_CACHE_ENV
from autotune.knobs.state import BuildExtras
from autotune.trial.build import build
from tests.models import MLP, classification_data

pytest.importorskip("onnxruntime")


def _run(path, x):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def test_a_second_export_of_the_same_model_reads_the_runs_cache_and_another_model_is_exported(tmp_path, monkeypatch):
    model, x = MLP().eval(), torch.randn(4, 16)
    assert "onnx_export_s" not in export_onnx(model, x, tmp_path / "none" / "m.onnx")  # outside a run: no cache
    monkeypatch.setenv(ONNX_CACHE_ENV, str(tmp_path / "cache"))
    first = export_onnx(model, x, tmp_path / "a" / "model.onnx")
    assert first["onnx_export_s"] > 0 and "onnx_cached" not in first
    again = export_onnx(copy.deepcopy(model), x, tmp_path / "b" / "model.onnx")  # a copy, as a worker holds
    assert again["onnx_cached"] and again["path"] == str(tmp_path / "b" / "model.onnx")
    assert again["input_names"] == first["input_names"] and again["exporter"] == first["exporter"]
    np.testing.assert_allclose(_run(again["path"], x), model(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.net[0].weight.add_(1.0)  # other weights: another model
    changed = export_onnx(other, x, tmp_path / "c" / "model.onnx")
    assert "onnx_cached" not in changed
    np.testing.assert_allclose(_run(changed["path"], x), other(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    assert export_onnx(model, x, tmp_path / "d" / "model.onnx", opset=19).get("onnx_cached") is None  # another opset


def test_an_onnx_runtime_trial_at_another_batch_size_reads_the_graph_the_first_exported(tmp_path, monkeypatch):
    monkeypatch.setenv(ONNX_CACHE_ENV, str(tmp_path / "cache"))
    data = classification_data()
    extras = BuildExtras(example=torch.utils.data.default_collate(data[:4]))
    first = build(MLP(), Config({"batch_size": 16, "runtime": "onnxruntime"}), "cpu", extras=extras)
    second = build(MLP(), Config({"batch_size": 32, "runtime": "onnxruntime", "num_threads": 1}), "cpu", extras=extras)
    assert first.info["onnx_export_s"] > 0 and second.info["onnx_cached"]
    batch = torch.utils.data.default_collate(data[:8])[0]
    with torch.no_grad():
        np.testing.assert_allclose(second.model(batch).numpy(), first.model(batch).numpy(), rtol=1e-5, atol=1e-6)


def test_a_damaged_entry_is_exported_again_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv(ONNX_CACHE_ENV, str(tmp_path / "cache"))
    model, x = MLP().eval(), torch.randn(4, 16)
    export_onnx(model, x, tmp_path / "a" / "model.onnx")
    (entry,) = (tmp_path / "cache").iterdir()
    (entry / "info.json").write_text("{not json")
    again = export_onnx(model, x, tmp_path / "b" / "model.onnx")
    assert "onnx_cached" not in again and again["onnx_export_s"] > 0  # made again, and put back
    np.testing.assert_allclose(_run(again["path"], x), model(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    assert export_onnx(model, x, tmp_path / "c" / "model.onnx")["onnx_cached"]
