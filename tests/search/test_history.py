"""A run leaves what its builds cost and gained for the next run of the same model on the machine,
and that run prices a first build of a kind from it."""

import copy
import json

import torch

import autotune
from autotune.export.run_cache import model_digest
from autotune.search.cost import trial_cost_s
from autotune.search.history import PAST_ATTR, history_key, past_builds, read_history, write_history
from tests.models import MLP, classification_data

BASE = {"runtime": "torch", "ov_precision": "fp32", "compile_mode": "none", "batch_size": 32}
OV_INT8 = {**BASE, "runtime": "openvino", "ov_precision": "int8_static"}


def _trial(config, wall_s, sps, **extra):
    return {"config": config, "ran": True, "status": "ok", "wall_s": wall_s, "samples_per_s": sps, **extra}


def _score(record):
    return record["samples_per_s"]


def test_a_first_build_is_priced_from_what_the_run_before_measured_less_what_the_cache_keeps():
    """Real MiniLM: a 90-s budget after a 16-trial run priced OpenVINO's int8 at 31 s (the prior:
    a conversion and NNCF's calibration), and refused it; the run before had measured it at 30 s,
    20 of them making the int8 model it left in the cache, and a cached build took 6-11 s."""
    baseline = _trial(BASE, 12.0, 150.0, baseline=True, n_params=22_700_000)
    plain = _trial({**BASE, "batch_size": 64}, 5.0, 500.0)
    made = _trial(OV_INT8, 30.0, 800.0, int8_made_s=20.0)
    past = past_builds([baseline, plain, made], baseline, _score)
    assert past == {"runtime=openvino,ov_precision=int8_static": {"extra_s": 5.0, "ratio": 1.6}}

    # The next run, with its own plain trial measured: a cheap trial (6 s) and what the build cost beyond one.
    now = [
        _trial(BASE, 11.0, 150.0, baseline=True, n_params=22_700_000),
        _trial({**BASE, "batch_size": 64}, 6.0, 520.0),
    ]
    assert trial_cost_s(OV_INT8, now, now[0], past) == 11.0
    assert trial_cost_s(OV_INT8, now, now[0]) > 25.0  # the priors: a conversion and a calibration
    # Measured in this run: that trial's cost, not the past's.
    assert trial_cost_s(OV_INT8, [*now, _trial(OV_INT8, 8.0, 820.0)], now[0], past) == 8.0


def test_the_history_is_kept_by_model_and_a_damaged_file_is_ignored(tmp_path):
    model = MLP()
    key = history_key(model_digest(model), 128)
    assert key is not None and history_key(model_digest(copy.deepcopy(model).eval()), 128) == key  # any copy, mode
    assert history_key(model_digest(model), 256) != key  # another dataset size: other costs
    assert history_key(model_digest(model), 128, "cpu other x2") != key  # another machine
    with torch.no_grad():
        model.net[0].weight.add_(1.0)
    assert history_key(model_digest(model), 128) != key  # other weights: another model (and other cache entries)
    assert history_key(None, 128) is None  # a model the digest cannot read: no history

    write_history(tmp_path, key, {"compile_mode=default": {"extra_s": 20.0, "ratio": 1.1}})
    write_history(tmp_path, key, {"quantization=int8_dynamic": {"extra_s": 1.0, "ratio": 0.9}})
    assert read_history(tmp_path, key) == {
        "compile_mode=default": {"extra_s": 20.0, "ratio": 1.1},
        "quantization=int8_dynamic": {"extra_s": 1.0, "ratio": 0.9},
    }
    (tmp_path / "history" / f"{key}.json").write_text("{not json")
    assert read_history(tmp_path, key) == {}
    assert read_history(None, key) == read_history(tmp_path, None) == {}


def test_a_second_run_of_the_same_model_reads_what_the_first_measured(tmp_path, monkeypatch):
    """Through ``optimize``: the first run leaves its int8 build's cost and speed beside the
    machine's cache; the second (a budget, the model given as a factory) starts its study with them."""
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    model, data = MLP(), classification_data(128)
    options = {
        "space": {"base": None, "quantization": ["none", "int8_dynamic"]},
        "measure": {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        "device": "cpu",
        "isolation": "inprocess",
        "export": (),
        "max_metric_drop": 1.0,
    }
    autotune.optimize(model, data, n_trials=2, out_dir=tmp_path / "first", **options)
    [saved] = (tmp_path / "cache").glob("*/history/*.json")
    kinds = json.loads(saved.read_text())["kinds"]
    [(label, int8)] = kinds.items()
    assert label.startswith("quantization=int8_dynamic") and int8["extra_s"] >= 0.0 and int8["ratio"] > 0

    # The same model from a factory (as a cfg.py often gives it): built in the worker, read the same.
    result = autotune.optimize(MLP, data, n_trials=3, budget=60, out_dir=tmp_path / "second", **options)
    assert result.study.user_attrs[PAST_ATTR] == kinds
    # Another model's run (other weights) starts from nothing.
    other = MLP()
    with torch.no_grad():
        other.net[0].bias.add_(1.0)
    other = autotune.optimize(other, data, n_trials=1, out_dir=tmp_path / "third", **options)
    assert other.study.user_attrs[PAST_ATTR] == {}


def test_a_trial_refused_on_the_runs_before_figures_says_so():
    import time

    import optuna

    from autotune.search.limits import _Limits
    from benchmarks.replay import TableRunner

    study = optuna.create_study()
    study.set_user_attr(PAST_ATTR, {"runtime=openvino,ov_precision=int8_static": {"extra_s": 40.0, "ratio": 1.5}})
    limits = _Limits(TableRunner({}), None, time.monotonic() + 30.0, 30.0, None, study)
    limits.baseline = {"config": BASE, "ran": True, "wall_s": 2.0}
    reason = limits.too_late(OV_INT8, [])
    assert "about 42 s" in reason and "here and in the runs before" in reason, reason
    assert limits.too_late({**BASE, "batch_size": 64}, []) is None
    # Without a deadline nothing is priced, and the runs before are not read.
    assert _Limits(TableRunner({}), None, None, None, None, study).past == {}
