"""Profiling in a run and on demand: both traces of a finished run, the switch that turns it
off, a failure that only warns, and ``autotune.profile`` / ``autotune profile``."""

import gzip
import json
import types

import pytest
import torch

import autotune
from autotune.cli import main
from autotune.errors import ConfigError, TrialError
from autotune.run.options import Options
from autotune.run.profile import profile_run
from tests.models import MLP, classification_data

QUIRKY_CFG = """
from tests.models import Quirky, classification_data
model = Quirky()
dataset = classification_data()
"""
OTHER_CFG = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
dataset = [(torch.randn(16), torch.tensor(i % 4)) for i in range(128)]
"""


def test_a_finished_run_wrote_both_traces_matching_its_tables(finished_run):
    best = json.loads((finished_run / "best_config.json").read_text())
    for label in ("baseline", "best"):
        summary = best["profile"][label]
        assert summary["trace"] == f"trace-{label}.json.gz"
        with gzip.open(finished_run / summary["trace"], "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert summary["operators"] and {o["name"] for o in summary["operators"]} <= names
        assert sum(v["share"] for v in summary["families"].values()) == pytest.approx(1.0)
        assert summary["profile_s"] < 10  # a second or two per pipeline, on a busy machine too
    # What profiling added to the run: both windows, and building both pipelines again.
    pipelines = ("baseline",) if best["profile"].get("same") else ("baseline", "best")  # the baseline won: one
    windows = sum(best["profile"][k]["profile_s"] for k in pipelines)
    assert windows <= best["profile"]["wall_s"] < 60


def _run(tmp_path, profile=True, call=None):
    runner = types.SimpleNamespace(call=call or (lambda *a, **k: pytest.fail("profiled with profile=False")))
    return types.SimpleNamespace(
        options=Options(profile=profile),
        left_s=lambda: None,
        runners=[runner],
        out=tmp_path,
        baseline={"key": "a", "config": {"batch_size": 8}},
        best={"key": "b", "config": {"batch_size": 16}},
        env=types.SimpleNamespace(device="cpu"),
        summary={},
    )


def test_profile_false_profiles_nothing(tmp_path):
    run = _run(tmp_path, profile=False)
    profile_run(run)
    assert "profile" not in run.summary and not list(tmp_path.glob("trace-*"))


def test_a_profiling_failure_warns_in_one_line_and_the_run_goes_on(tmp_path):
    def fail(*args, **kwargs):
        raise TrialError("error", "profile failed in the worker: RuntimeError: no kineto")

    run = _run(tmp_path, call=fail)
    with pytest.warns(RuntimeWarning, match="Profiling failed") as caught:
        profile_run(run)
    assert "\n" not in str(caught[0].message)
    assert run.summary["profile"]["error"].startswith("not profiled: TrialError")


def test_profile_must_be_a_bool():
    with pytest.raises(ConfigError, match="`profile` must be True or False"):
        Options(profile="yes")


def test_autotune_profile_writes_the_trace_and_summary(tmp_path):
    summary = autotune.profile(MLP(), classification_data(), out_dir=tmp_path, device="cpu")
    assert summary["trace"] == "trace-baseline.json.gz" and (tmp_path / "trace-baseline.json.gz").is_file()
    assert json.loads((tmp_path / "profile-baseline.json").read_text())["operators"] == summary["operators"]
    train = autotune.profile(
        MLP(),
        classification_data(),
        {"batch_size": 16},
        out_dir=tmp_path,
        label="train",
        device="cpu",
        mode="train",
        loss_fn=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),
        optimizer=torch.optim.SGD,
    )
    assert train["stages"]["backward"]["ms"] > 0


def test_cli_profile_of_a_finished_run(finished_run, tmp_path, capsys):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(QUIRKY_CFG)
    assert main(["profile", str(cfg), "--config", str(finished_run), "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "ui.perfetto.dev" in out and "stages: loader_wait" in out
    assert (tmp_path / "p" / "trace-best.json.gz").is_file()


def test_cli_profile_bad_input_is_one_line_and_exit_2(finished_run, tmp_path, capsys):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(OTHER_CFG)
    assert main(["profile", str(cfg), "--config", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No config at" in err
    assert main(["profile", str(cfg), "--config", str(finished_run), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tuned for another model" in err
    assert not (tmp_path / "p").exists()
