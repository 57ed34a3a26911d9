"""Multi-fidelity: screening trials are timed on fewer windows, and a trial far below the best
so far stops after its first window, unguarded, recorded as ``stopped`` with the time saved."""

import csv
import json

import torch
from optuna.trial import TrialState

from autotune.config import Config
from autotune.report.story import story_lines
from autotune.search.phases import search_story
from autotune.search.study import SCREEN_SHARE, trial_fidelity
from autotune.trial.build import build
from autotune.trial.inference import TrialContext
from autotune.trial.measure import MeasureSettings, measure
from autotune.trial.spec import WorkerSpec
from tests.models import MLP, classification_data


class _SleepyMLP(MLP):
    """2 ms of sleep per call: one sample per batch is many times slower than 32 on any machine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.002)
        return super().forward(x)


SETTINGS = MeasureSettings(n_windows=4, window_s=0.05, warmup_batches=1, n_remeasure=0)


def _context() -> TrialContext:
    spec = WorkerSpec(model=_SleepyMLP(), dataset=classification_data(128), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 32})), val_indices=list(range(16)), measure=SETTINGS)  # fmt: skip
    return TrialContext(spec)


def test_a_measurement_under_its_floor_stops_after_the_first_window():
    state = build(_SleepyMLP(), Config({"batch_size": 1}), "cpu")
    stopped = measure(state, classification_data(64), SETTINGS, stop_below=1e9)
    assert stopped["stopped"] and stopped["n_windows"] == 1 and stopped["samples_per_s"] > 0


def test_a_window_of_too_few_batches_is_no_evidence_to_stop():
    """Windows of one slow batch each (a loader worker's first decode, say) do not stop a
    measurement: it stops only once STOP_MIN_BATCHES batches were timed."""
    from autotune.trial.measure import STOP_MIN_BATCHES

    state = build(_SleepyMLP(), Config({"batch_size": 1}), "cpu")
    one_batch_windows = MeasureSettings(n_windows=STOP_MIN_BATCHES + 1, window_s=0.0, warmup_batches=1)
    result = measure(state, classification_data(64), one_batch_windows, stop_below=1e9)
    assert result["stopped"] and result["n_windows"] == STOP_MIN_BATCHES
    full = measure(state, classification_data(64), SETTINGS, stop_below=1.0)
    assert not full["stopped"] and full["n_windows"] == SETTINGS.n_windows


def test_a_trial_far_below_the_best_is_stopped_unguarded_and_says_what_it_saved():
    ctx = _context()
    slow = dict(Config({"batch_size": 1}))
    # The best so far runs 1e9 samples/s: this trial's first window is far below 75% of it.
    result = ctx.run_trial(slow, {"best": 1e9}).to_attrs()
    assert result["status"] == "stopped" and result["kind"] == "early-stop"
    assert "stopped after 1 of 4 windows" in result["reason"] and "75%" in result["reason"]
    assert result["n_windows"] == 1 and "metric" not in result  # the guard did not run
    assert result["fidelity_saved_s"] >= 3 * SETTINGS.window_s  # three windows not timed
    # Its size is read, its compressed size (seconds of zlib on a real model's weights) is not.
    assert result["size_bytes"] > 0 and result["size_bytes_compressed"] is None
    # Near the best, the same trial is timed and guarded fully.
    near = ctx.run_trial(slow, {"best": result["samples_per_s"]}).to_attrs()
    assert near["status"] == "ok" and near["n_windows"] == SETTINGS.n_windows and "metric" in near
    assert 0 < near["size_bytes_compressed"] <= near["size_bytes"]


def test_a_screening_trial_times_half_the_windows():
    ctx = _context()
    short = ctx.run_trial(dict(Config({"batch_size": 64})), {"share": SCREEN_SHARE}).to_attrs()
    assert short["status"] == "ok" and short["n_windows"] == 2 and short["fidelity_saved_s"] > 0
    full = ctx.run_trial(dict(Config({"batch_size": 64}))).to_attrs()
    assert full["n_windows"] == SETTINGS.n_windows and full["fidelity_saved_s"] == 0


def test_only_screening_is_short_and_only_throughput_stops_early():
    class Trial:
        def __init__(self, status, sps):
            self.user_attrs = {"status": status, "samples_per_s": sps}

    done = [Trial("ok", 100.0), Trial("infeasible", 900.0), Trial("ok", 250.0)]
    # The best feasible trial sets the floor; an infeasible one's speed does not.
    assert trial_fidelity("screen", False, ["throughput"], done) == {"share": SCREEN_SHARE, "best": 250.0}
    assert trial_fidelity("compose", False, ["throughput", "size"], done) == {"best": 250.0}
    assert trial_fidelity(None, True, ["throughput"], done) == {"paired": True}  # the baseline: timed fully
    assert trial_fidelity(None, False, ["latency"], done) == {}
    assert trial_fidelity(None, False, ["throughput"], []) == {}


def test_a_study_records_the_stopped_trial_as_pruned_and_reports_the_time_saved(tmp_path):
    import autotune

    result = autotune.optimize(
        _SleepyMLP(),
        classification_data(128),
        space={"base": None, "batch_size": [1]},
        baseline_batch_size=32,
        measure={"n_windows": 3, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=2,
        out_dir=tmp_path,
        device="cpu",
        isolation="inprocess",
        export=(),
        profile=False,
    )
    stopped = [t for t in result.study.trials if t.user_attrs.get("status") == "stopped"]
    assert len(stopped) == 1 and stopped[0].state == TrialState.PRUNED
    assert stopped[0].user_attrs["config"]["batch_size"] == 1
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert [r["status"] for r in rows if r["batch_size"] == "1"] == ["stopped"]
    story = json.loads((tmp_path / "best_config.json").read_text())["search"]
    assert story["fidelity"]["stopped"] == 1 and story["fidelity"]["saved_s"] > 0
    assert "1 trials stopped early" in (tmp_path / "report.md").read_text()
    # The model as given stands: nothing measured faster.
    assert result.best_config["batch_size"] == 32


def test_the_story_counts_short_and_stopped_trials_and_their_savings():
    records = [
        {"number": 0, "ran": True, "baseline": True, "wall_s": 2.0, "status": "ok"},
        {"number": 1, "ran": True, "phase": "screen", "wall_s": 1.0, "status": "ok", "fidelity_saved_s": 0.5},
        {"number": 2, "ran": True, "wall_s": 1.0, "status": "stopped", "fidelity_saved_s": 3.0},
    ]
    story = search_story(records, "staged")
    assert story["fidelity"] == {"short": 1, "stopped": 1, "saved_s": 3.5}
    assert any(line.startswith("multi-fidelity: 1 screening trials") for line in story_lines(story))


def test_a_cheap_trial_is_stopped_against_the_cheap_best_not_a_compiled_one():
    """Refinement varies the cheap knobs around the fastest eager configuration, and a better one
    gets the compile again: a cheap trial is measured against the cheap ones, a compiled trial
    against the compiled ones, so an eager trial under a compiled best is not cut short for it."""
    from autotune.search.phases import converged
    from benchmarks.replay import space_of

    space = space_of({"batch_size": [32, 64], "compile_mode": ["none", "default"]})
    eager, compiled = dict(space.baseline), {**space.baseline, "compile_mode": "default"}

    class Trial:
        def __init__(self, config, sps):
            self.user_attrs = {"status": "ok", "samples_per_s": sps, "config": config}

    done = [Trial(eager, 100.0), Trial({**eager, "batch_size": 64}, 150.0), Trial(compiled, 300.0)]
    assert trial_fidelity("refine", False, ["throughput"], done, space, {**eager, "batch_size": 32}) == {"best": 150.0}
    assert trial_fidelity("compose", False, ["throughput"], done, space, compiled) == {"best": 300.0}
    assert trial_fidelity("refine", False, ["throughput"], done, space) == {"best": 300.0}  # no config: all

    # A refinement trial that beats the eager ones is progress, though under the compiled best.
    def row(i, config, sps, phase="refine"):
        return {"ran": True, "number": i, "status": "ok", "samples_per_s": sps, "cov": 0.01, "phase": phase,
                "config": config, "baseline": i == 0}  # fmt: skip

    rows = [row(0, eager, 100.0, None), row(1, compiled, 300.0, "compose")]
    rows += [row(i, {**eager, "batch_size": 64}, v) for i, v in enumerate([110.0, 100.0, 101.0, 99.0, 100.0], 2)]
    assert converged(rows, "samples_per_s") is None  # trial 2 beat the eager best by 10%
    rows += [row(7, eager, 99.0)]
    assert converged(rows, "samples_per_s") is not None  # five in a row after it did not
