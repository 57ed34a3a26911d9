"""apply() rebuilds the model a run measured: the same calibration samples and the same int8 layers
kept float, from the run's directory or from ``result.best_config`` alone."""

import importlib.util
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import autotune
from autotune.config import Config
from tests.models import FragileMLP, LineRecognizer, line_data, pad_to_widest, vector_data

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


@pytest.mark.parametrize(
    "fix",
    [
        {"runtime": "onnxruntime", "ort_precision": "int8_dynamic", "int8_fallback": "auto"},
        {"prune_ratio": 0.3, "prune_method": "structured"},
    ],
    ids=["onnxruntime-int8", "pruned"],
)
def test_a_runs_winner_is_rebuilt_without_the_dataset_from_its_folder_and_its_result(tmp_path, fix):
    """The README's Python API block: ``apply(model, result.best_config)`` refused every winner
    that reads example inputs ("pass dataset="), though the run had them."""
    data = vector_data(160)
    result = _run(tmp_path, {**fix, "batch_size": 16}, data, max_metric_drop=1.0)
    assert (tmp_path / "build_inputs.pt").is_file()
    x = torch.stack(data[:8])
    with_data = autotune.apply(FragileMLP(), tmp_path, dataset=data, device="cpu")
    with torch.no_grad():
        expected = with_data(x)
        for config in (tmp_path, tmp_path / "best_config.json", result.best_config):
            rebuilt = autotune.apply(FragileMLP(), config, device="cpu")
            torch.testing.assert_close(rebuilt(x), expected)


def test_a_hand_written_config_that_reads_inputs_still_asks_for_the_dataset():
    with pytest.raises(autotune.ConfigError, match="dataset="):
        autotune.apply(FragileMLP(), {"runtime": "onnxruntime"}, device="cpu")


@pytest.mark.skipif(
    importlib.util.find_spec("openvino") is None, reason="OpenVINO is not installed (the openvino extra)"
)
def test_an_openvino_winner_on_images_of_many_widths_runs_every_width_in_the_users_paths(tmp_path):
    """The trials converted with a dynamic width; the user's build did not, and failed on the
    first batch of another width."""
    samples = line_data(40)
    loader = DataLoader(samples, batch_size=8, collate_fn=pad_to_widest)
    result = autotune.optimize(
        LineRecognizer(), loader, space={"base": None}, fix={"batch_size": 16, "runtime": "openvino"}, n_trials=2,
        out_dir=tmp_path, export=("onnx",), device="cpu", isolation="inprocess", measure=FAST, n_verify_pairs=2,
    )  # fmt: skip
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["config"]["runtime"] == "openvino" and best["rebuild"]["ragged"]
    reference = LineRecognizer().eval()
    by_width = {
        w: pad_to_widest([s for s in samples if s[0].shape[-1] == w][:2])[0] for w in {x.shape[-1] for x, _ in samples}
    }
    assert len(by_width) > 5
    served = autotune.load(tmp_path)
    for tuned in (autotune.apply(LineRecognizer(), tmp_path, device="cpu"),
                  autotune.apply(LineRecognizer(), result.best_config, device="cpu"),  # the README's block
                  autotune.apply(LineRecognizer(), tmp_path, dataset=loader, device="cpu"), served):  # fmt: skip
        with torch.no_grad():
            for images in by_width.values():
                torch.testing.assert_close(torch.as_tensor(tuned(images)), reference(images), atol=1e-3, rtol=1e-3)
            for images, _ in autotune.dataloader(samples, tmp_path, collate_fn=pad_to_widest):
                torch.testing.assert_close(torch.as_tensor(tuned(images)), reference(images), atol=1e-3, rtol=1e-3)
    outputs = autotune.predict(LineRecognizer(), loader, tmp_path, device="cpu")
    assert len(outputs) == len(samples)
