"""apply() rebuilds the model a run measured: the same calibration samples and the same int8 layers
kept float, from the run's directory or from ``result.best_config`` alone."""

import json

import numpy as np
import pytest
import torch

import autotune
from autotune.config import Config
from tests.models import FragileMLP, vector_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}
# Size first: the int8 candidate wins on its bytes whatever the timings; the guard never vetoes it.
COMMON = {"device": "cpu", "isolation": "inprocess", "measure": FAST, "n_verify_pairs": 2, "objectives": ["size"]}


def _run(tmp_path, fix, data, **options):
    return autotune.optimize(
        FragileMLP(), data, space={"base": None}, fix=fix, n_trials=2, out_dir=tmp_path, export=("onnx",),
        **{**COMMON, **options},
    )  # fmt: skip


def _shipped(out_dir, x):
    """The ONNX Runtime winner's own graph, as the run measured and shipped it."""
    return torch.from_numpy(np.asarray(autotune.load(out_dir, format="onnx")(x.numpy())))


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_static_int8_calibrates_on_the_samples_the_search_drew(tmp_path):
    # The validation subset is small, so the search calibrates on a seeded draw of the other
    # samples at the baseline batch size (32), not on the first batches at the winner's (16).
    data = vector_data(400, seed=2)
    fix = {"runtime": "onnxruntime", "ort_precision": "int8_static", "int8_fallback": 0, "batch_size": 16}
    result = _run(tmp_path, fix, data, n_val=32, max_metric_drop=1.0, seed=5)
    rebuild = result.best_config["rebuild"]
    assert (rebuild["n_val"], rebuild["seed"], rebuild["calibration_batch_size"]) == (32, 5, 32)
    assert Config(result.best_config)["ort_precision"] == "int8_static"  # the record is not a knob
    x = torch.stack(vector_data(24, seed=9))
    shipped = _shipped(tmp_path, x)
    for config in (result.best_config, json.loads(json.dumps(result.best_config)), tmp_path):
        tuned = autotune.apply(FragileMLP(), config, dataset=data, device="cpu")
        with torch.inference_mode():
            torch.testing.assert_close(tuned(x), shipped, atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_a_plain_best_config_keeps_the_layers_the_run_kept_float(tmp_path):
    # No guard: the run keeps no layer float; a new ranking at the default threshold would keep fc.2.
    fix = {"runtime": "onnxruntime", "ort_precision": "int8_dynamic", "int8_fallback": "auto"}
    result = _run(tmp_path, fix, vector_data(), max_metric_drop=1.0)
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert result.best_config["rebuild"]["int8_kept_float"] == best["int8"]["kept_float"] == []
    assert "rebuild" not in best["config"]  # the file's config holds knob values only
    x = torch.stack(vector_data(24, seed=9))
    shipped = _shipped(tmp_path, x)
    tuned = autotune.apply(FragileMLP(), dict(result.best_config), dataset=vector_data(), device="cpu")
    with torch.inference_mode():
        torch.testing.assert_close(tuned(x), shipped, atol=1e-6, rtol=1e-6)
