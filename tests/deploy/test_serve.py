"""autotune.load serves the fastest candidate here (the exported files and, with the original
model, the tuned torch pipeline), compares it with the untuned model, and names it truthfully."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import autotune
from autotune.deploy.serve import TorchPredictor, decide
from autotune.runtimes.artifacts import export_artifacts
from tests.models import SmallCNN


def _run(out_dir, model, baseline_rate: float | None = None) -> list:
    """A run directory as export writes it: both artifacts, best_config.json and parity.pt."""
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randn(1, 8, 8, generator=gen), torch.tensor(0)) for _ in range(16)]
    artifacts = export_artifacts(model, default_collate(samples[:8]), samples, 8, out_dir, ["onnx", "torchscript"])
    assert all(a["status"] == "ok" for a in artifacts.values()), artifacts
    best = {"config": {"batch_size": 8}, "best": {"batch_size": 8}, "artifacts": artifacts}
    if baseline_rate is not None:
        best["baseline"] = {"samples_per_s": baseline_rate}
    (out_dir / "best_config.json").write_text(json.dumps(best))
    with torch.no_grad():
        outputs = model(torch.stack([s[0] for s in samples]))
    torch.save({"samples": samples, "outputs": outputs}, out_dir / "parity.pt")
    return samples


def test_decide_serves_the_fastest_and_says_how_it_compares_with_the_untuned_model():
    pick, chosen, slower = decide({"onnx": 77.0, "torch": 330.0}, untuned=100.0, recorded=None)
    assert pick == "torch" and slower is None
    assert "torch (the tuned pipeline) 330/s" in chosen and "onnx 77/s" in chosen and "3.30x" in chosen
    pick, chosen, slower = decide({"onnx": 77.0, "torchscript": 60.0}, untuned=100.0, recorded=None)
    assert pick == "onnx" and "SLOWER than the untuned model" in slower and "0.77x" in slower
    assert slower in chosen and "\n" not in slower


def test_decide_without_the_model_compares_with_the_recorded_baseline_and_says_what_that_is():
    pick, chosen, slower = decide({"onnx": 500.0}, untuned=None, recorded=100.0)
    assert pick == "onnx" and slower is None
    assert "run's baseline was 100/s" in chosen and "end-to-end" in chosen and "pass model=" in chosen
    _, chosen, slower = decide({"onnx": 50.0}, untuned=None, recorded=100.0)
    assert "below the run's baseline" in slower and slower in chosen and "pass model=" in slower
    _, chosen, slower = decide({"onnx": 50.0}, untuned=None, recorded=None)
    assert slower is None and "not compared with the untuned model" in chosen


def test_load_with_the_model_times_the_tuned_pipeline_and_the_untuned_model(tmp_path):
    model = SmallCNN().eval()
    samples = _run(tmp_path, model)
    served = autotune.load(tmp_path, model=model)
    for name in ("torch (the tuned pipeline)", "onnx", "torchscript", "the untuned model"):
        assert f"{name} " in served.chosen, served.chosen
    assert served.format in ("torch", "onnx", "torchscript") and served.chosen.startswith(served.format + ":")
    x = torch.stack([s[0] for s in samples[:13]])
    with torch.no_grad():
        expected = model(x)
    np.testing.assert_allclose(served(x.numpy()), expected.numpy(), rtol=1e-4, atol=1e-5)
    assert model.training is False  # the caller's model is left as it was given


def test_the_tuned_torch_pipeline_has_the_artifacts_interface(tmp_path):
    model = SmallCNN().eval()
    samples = _run(tmp_path, model)
    served = autotune.load(tmp_path, model=model, format="torch")
    assert isinstance(served, TorchPredictor) and served.format == "torch" and "tuned pipeline" in served.chosen
    x = torch.stack([s[0] for s in samples[:13]])  # a full chunk of 8 and a padded one of 5
    with torch.no_grad():
        expected = model(x)
    out = served(x.numpy())
    assert isinstance(out, np.ndarray) and out.shape == (13, 4)
    torch.testing.assert_close(served(x), expected, rtol=1e-4, atol=1e-5)
    got = served.predict([s[0] for s in samples[:5]])
    assert len(got) == 5 and tuple(got[0].shape) == (4,)
    torch.testing.assert_close(torch.stack(got), expected[:5], rtol=1e-4, atol=1e-5)
    with pytest.raises(autotune.ConfigError, match="pass the original model"):
        autotune.load(tmp_path, format="torch")


def test_load_without_the_model_says_what_it_compared_against_and_warns_when_slower(tmp_path):
    _run(tmp_path, SmallCNN().eval(), baseline_rate=1e12)  # a baseline no file can reach
    with pytest.warns(UserWarning, match="below the run's baseline"):
        served = autotune.load(tmp_path)
    assert served.format in ("onnx", "torchscript") and "torch (the tuned pipeline)" not in served.chosen
    assert "end-to-end figure" in served.chosen and "pass model=" in served.chosen


def test_a_bfloat16_and_compiled_winners_float_onnx_is_labelled_another_model(tmp_path):
    """Constructed from the build state, so it runs on any CPU: the float32 ONNX of a bfloat16,
    compiled winner lacks both, says so, and load() never calls it the measured winner."""
    from autotune.knobs.state import BuildState, wrap
    from autotune.runtimes.base import get_runtime
    from autotune.trial.inference import _export_form, _label

    model = SmallCNN().eval()
    state = BuildState(model=model, device="cpu", amp_dtype="bfloat16", compile_mode="max-autotune-no-cudagraphs")
    _, note = _export_form(get_runtime("onnxruntime"), wrap(state), "cpu")
    _run(tmp_path, model)
    path = tmp_path / "best_config.json"
    best = json.loads(path.read_text())
    onnx, script = best["artifacts"]["onnx"], best["artifacts"]["torchscript"]
    onnx["form_note"] = note
    for fmt, record in best["artifacts"].items():
        _label(record, fmt, state, None)
    assert onnx["winner"] is False and script["winner"] is False
    for part in ("float32", "bfloat16", "torch.compile", "another model"):
        assert part in onnx["form_note"], onnx["form_note"]
    del best["artifacts"]["torchscript"]
    path.write_text(json.dumps(best))
    (tmp_path / "parity.pt").unlink()  # nothing to time on: the untimed choice names it too
    for fmt in ("onnx", None):
        chosen = autotune.load(tmp_path, format=fmt).chosen
        assert "NOT the measured winner" in chosen and "torch.compile" in chosen
        assert "winner's file" not in chosen and "winner's own form" not in chosen
