"""The file a run writes is a config: apply, dataloader and predictor take the run's directory,
the whole ``best_config.json`` as ``json.load`` reads it, or its ``config`` part."""

import json

import numpy as np
import pytest
import torch

import autotune
from autotune.errors import InputError
from tests.models import FragileMLP, vector_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}
COMMON = {"device": "cpu", "isolation": "inprocess", "measure": FAST, "n_verify_pairs": 2, "objectives": ["size"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An int8 run whose draw is not the default one (n_val=32, seed=5): a config read without
    its rebuild record would calibrate on other samples."""
    out = tmp_path_factory.mktemp("run")
    fix = {"runtime": "onnxruntime", "ort_precision": "int8_static", "int8_fallback": 0, "batch_size": 16}
    data = vector_data(400, seed=2)
    autotune.optimize(
        FragileMLP(), data, space={"base": None}, fix=fix, n_trials=2, out_dir=out, export=("onnx",),
        n_val=32, max_metric_drop=1.0, seed=5, **COMMON,
    )  # fmt: skip
    return out, data


def test_apply_takes_the_whole_best_config_json_and_rebuilds_the_run(run):
    out, data = run
    whole = json.loads((out / "best_config.json").read_text())
    x = torch.stack(vector_data(24, seed=9))
    shipped = torch.from_numpy(np.asarray(autotune.load(out, format="onnx")(x.numpy())))
    tuned = autotune.apply(FragileMLP(), whole, dataset=data, device="cpu")
    with torch.inference_mode():
        torch.testing.assert_close(tuned(x), shipped, atol=1e-6, rtol=1e-6)
    assert (
        autotune.Config(whole["config"])
        == autotune.Config(whole)
        == autotune.Config.from_json((out / "best_config.json").read_text())
    )


def test_dataloader_and_predictor_take_the_whole_dict(run):
    out, data = run
    whole = json.loads((out / "best_config.json").read_text())
    for config in (whole, whole["config"]):
        assert autotune.dataloader(data, config).batch_size == 16
    x = vector_data(5, seed=3)
    via_dict = autotune.predictor(FragileMLP(), whole, dataset=data, device="cpu")(x)
    via_path = autotune.predictor(FragileMLP(), out, dataset=data, device="cpu")(x)
    for a, b in zip(via_dict, via_path, strict=True):
        torch.testing.assert_close(a, b)


def test_load_config_names_a_run_for_what_it_is(run):
    out, _ = run
    for path in (out, out / "best_config.json"):
        with pytest.raises(
            InputError, match=r"is a run.s config, not a cfg\.py: pass it as `config` to autotune\.apply"
        ):
            autotune.load_config(path)
