"""autotune.load: artifacts written by export_artifacts, run numpy in/numpy out and torch
in/torch out, in chunks of the recorded batch size; failed artifacts refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from autotune.deploy.load import Predictor
from autotune.deploy.serve import load
from autotune.errors import ConfigError, InputError
from autotune.runtimes.artifacts import export_artifacts
from tests.models import SmallCNN


class Pair(nn.Module):
    """Two keyword inputs of different dtypes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.linear = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(self.embed(ids).mean(1)) * scale[:, None]


def _write_run(out_dir, artifacts: dict, batch_size: int = 8) -> None:
    best = {"config": {"batch_size": batch_size}, "best": {"batch_size": batch_size}, "artifacts": artifacts}
    (out_dir / "best_config.json").write_text(json.dumps(best))


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("run")
    model = SmallCNN().eval()
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randn(1, 8, 8, generator=gen), torch.tensor(0)) for _ in range(16)]
    artifacts = export_artifacts(model, default_collate(samples[:8]), samples, 8, out_dir, ["onnx", "torchscript"])
    assert all(a["status"] == "ok" for a in artifacts.values()), artifacts
    _write_run(out_dir, artifacts)
    return model, out_dir


@pytest.mark.parametrize("fmt", [None, "torchscript"])
def test_numpy_in_numpy_out_and_torch_in_torch_out(cnn_run, fmt):
    model, out_dir = cnn_run
    predict = load(out_dir, format=fmt)
    assert isinstance(predict, Predictor) and predict.format == (fmt or "onnx") and predict.batch_size == 8
    x = torch.randn(13, 1, 8, 8)  # one full chunk of 8 and a padded one of 5
    with torch.no_grad():
        expected = model(x)
    out = predict(x.numpy())
    assert isinstance(out, np.ndarray) and out.shape == (13, 4)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-4, atol=1e-5)
    out = predict(x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_keyword_inputs_by_dict_or_by_position(tmp_path):
    model = Pair().eval()
    gen = torch.Generator().manual_seed(0)
    samples = [
        {"ids": torch.randint(0, 10, (5,), generator=gen), "scale": torch.rand(1, generator=gen)[0]} for _ in range(8)
    ]
    artifacts = export_artifacts(model, default_collate(samples[:4]), samples, 4, tmp_path, ["onnx", "torchscript"])
    assert all(a["status"] == "ok" for a in artifacts.values()), artifacts
    _write_run(tmp_path, artifacts, batch_size=4)
    ids, scale = np.random.default_rng(0).integers(0, 10, (6, 5)), np.linspace(0.5, 1.5, 6, dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids), torch.from_numpy(scale)).numpy()
    for fmt in ("onnx", "torchscript"):
        predict = load(tmp_path, format=fmt)
        np.testing.assert_allclose(predict({"ids": ids, "scale": scale}), expected, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(predict((ids, scale)), expected, rtol=1e-4, atol=1e-6)


def test_failed_artifacts_are_refused_unless_named(cnn_run, tmp_path):
    _, run_dir = cnn_run
    artifacts = json.loads((run_dir / "best_config.json").read_text())["artifacts"]
    for name in ("model.onnx", "model.pt"):
        (tmp_path / name).write_bytes((run_dir / name).read_bytes())
    artifacts["onnx"].update(status="failed", error="parity: outputs differ")
    _write_run(tmp_path, artifacts)
    assert load(tmp_path).format == "torchscript"  # ONNX is preferred, but it failed
    artifacts["torchscript"].update(status="failed", error="parity: the metric drops")
    _write_run(tmp_path, artifacts)
    with pytest.raises(ConfigError, match=r"No artifact .* passed its checks .*onnx: parity: outputs differ"):
        load(tmp_path)
    with pytest.warns(UserWarning, match="failed its checks: parity: outputs differ"):
        predict = load(tmp_path, format="onnx")
    assert predict(np.zeros((2, 1, 8, 8), np.float32)).shape == (2, 4)


def test_clear_errors_for_missing_or_empty_runs(tmp_path, cnn_run):
    with pytest.raises(ConfigError, match="No directory"):
        load(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"No best_config\.json"):
        load(tmp_path)
    _write_run(tmp_path, {})
    with pytest.raises(ConfigError, match="lists no artifacts"):
        load(tmp_path)
    with pytest.raises(ConfigError, match="Known: onnx, torchscript"):
        load(cnn_run[1], format="tflite")
    _write_run(tmp_path, {"onnx": {"path": "model.onnx", "status": "ok", "input_names": ["input_0"]}})
    with pytest.raises(ConfigError, match="is missing"):
        load(tmp_path)


class PairDict(Pair):
    """Keyword inputs, a dict of outputs."""

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> dict:
        logits = super().forward(ids, scale)
        return {"logits": logits, "probs": logits.softmax(-1)}


def test_keyword_calls_and_the_same_output_structure_from_every_format(tmp_path):
    model = PairDict().eval()
    gen = torch.Generator().manual_seed(0)
    samples = [
        {"ids": torch.randint(0, 10, (5,), generator=gen), "scale": torch.rand(1, generator=gen)[0]} for _ in range(8)
    ]
    artifacts = export_artifacts(model, default_collate(samples[:4]), samples, 4, tmp_path, ["onnx", "torchscript"])
    assert all(a["status"] == "ok" for a in artifacts.values()), artifacts
    _write_run(tmp_path, artifacts, batch_size=4)
    batch = default_collate(samples[:6])
    with torch.no_grad():
        expected = model(**batch)
    for fmt in ("onnx", "torchscript"):
        predict = load(tmp_path, format=fmt)
        for out in (predict(**batch), predict(batch)):
            assert isinstance(out, dict) and list(out) == ["logits", "probs"], (fmt, type(out))
            torch.testing.assert_close(out["logits"], expected["logits"], rtol=1e-4, atol=1e-5)
    with pytest.raises(InputError, match="not both"):
        predict(batch, **batch)


def _tuned_on(out_dir, device: str) -> None:
    """Record in the run's best_config.json that it was tuned on ``device``."""
    path = out_dir / "best_config.json"
    best = json.loads(path.read_text())
    best["env"] = {"device": device}
    path.write_text(json.dumps(best))


@pytest.fixture
def copied_run(cnn_run, tmp_path):
    """A copy of the CNN run that a test may record another device in."""
    import shutil

    model, run_dir = cnn_run
    return model, shutil.copytree(run_dir, tmp_path / "run")


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without CUDA")
@pytest.mark.parametrize("fmt", ["onnx", "torchscript", None])
def test_a_cuda_run_loads_on_the_cpu_here_and_says_so(copied_run, fmt):
    model, run_dir = copied_run
    _tuned_on(run_dir, "cuda:0")
    with pytest.warns(UserWarning, match=r"tuned on 'cuda:0', which this machine lacks: it runs on the CPU"):
        predict = load(run_dir, format=fmt)
    assert predict.device == torch.device("cpu")
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(predict(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_cuda_run_is_served_on_cuda_where_the_machine_has_it(copied_run, monkeypatch):
    from autotune.deploy.load import run_device

    _, run_dir = copied_run
    _tuned_on(run_dir, "cuda:0")
    # What a CUDA machine says (this one has no GPU): the recorded device is the one taken.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert run_device(run_dir) == "cuda:0"


def test_a_cpu_run_loads_on_the_cpu_without_a_warning_and_an_explicit_device_wins(copied_run):
    import warnings

    _, run_dir = copied_run
    _tuned_on(run_dir, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(run_dir, format="onnx").device == torch.device("cpu")
        _tuned_on(run_dir, "cuda:0")
        assert load(run_dir, format="onnx", device="cpu").device == torch.device("cpu")
