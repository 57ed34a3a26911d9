"""The search: baseline first, no configuration measured twice, persistent storage, resume."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import optuna
import pytest

import autotune
from tests.models import MLP, classification_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_baseline_first_no_repeats_and_results_written(tmp_path):
    result = autotune.optimize(
        MLP(),
        classification_data(),
        space={"base": None, "batch_size": [8, 16, 32], "num_threads": "all"},
        out_dir=tmp_path,
        baseline_batch_size=8,
        measure=FAST,
        n_verify_pairs=2,
        n_trials=30,
        device="cpu",
    )
    trials = result.study.trials
    assert trials[0].user_attrs["baseline"] and trials[0].user_attrs["config"]["batch_size"] == 8
    measured = [t for t in trials if t.user_attrs.get("ran")]
    keys = [t.user_attrs["key"] for t in measured]
    assert len(keys) == len(set(keys)), "a configuration was measured twice"
    assert result.stop_reason == "exhausted" and len(measured) <= 3 * 2
    saved = json.loads((tmp_path / "best_config.json").read_text())
    assert saved["schema_version"] == 1 and saved["config"] == result.best_config
    claim = saved["speedup"]
    # Which verdict a one-thread or small-batch pick gets depends on the CPU and its load; each
    # is a complete, written result.
    assert claim["method"] in (
        "confirmation rounds",
        "no measurable speedup",
        "baseline is best",
        "pick slower, baseline kept",
        "not claimed, baseline kept",
    )
    assert saved["env"]["device"] == "cpu"
    if claim["method"] == "confirmation rounds":
        # One measurement behind every figure: the claim is the ratio of the figures shown.
        assert claim["speedup"] == pytest.approx(saved["best"]["samples_per_s"] / saved["baseline"]["samples_per_s"])
        assert claim["low"] <= claim["speedup"] <= claim["high"] and claim["n_rounds"] >= 2
        assert result.speedup == claim["speedup"] and result.verdict == claim["verdict"]
        if len(saved["finalists"]) > 1:  # picked on the selection rounds
            assert saved["trial"] == next(f["trial"] for f in saved["finalists"] if f.get("picked"))
    assert saved["study"]["storage"].startswith("sqlite:///") and (tmp_path / "study.db").exists()
    # The study is in SQLite, readable by plain optuna.
    loaded = optuna.load_study(study_name="autotune", storage=saved["study"]["storage"])
    assert len(loaded.trials) == len(trials)


@pytest.mark.slow
def test_existing_study_is_not_touched_without_resume(tmp_path):
    args = dict(
        space={"base": None, "batch_size": [8, 16]},
        out_dir=tmp_path,
        baseline_batch_size=8,
        measure=FAST,
        n_trials=2,
        device="cpu",
        isolation="inprocess",
    )
    autotune.optimize(MLP(), classification_data(), **args)
    with pytest.raises(autotune.ConfigError, match=r"already exists.*resume"):
        autotune.optimize(MLP(), classification_data(), **args)
    again = autotune.optimize(MLP(), classification_data(), resume=True, **args)
    assert sum(t.user_attrs.get("baseline", False) for t in again.study.trials) == 1


CFG = """
import time, torch
from torch import nn

class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
    def forward(self, x):
        time.sleep(0.002)
        return self.lin(x)

model = Slow()
dataset = [torch.randn(8) for _ in range(64)]
space = {"base": None, "batch_size": [1, 2, 4, 8, 16, 32, 64], "num_threads": "all"}
options = {"measure": {"n_windows": 2, "window_s": 0.3, "warmup_batches": 1, "n_remeasure": 0}, "baseline_batch_size": 8,
           "n_verify_pairs": 1, "device": "cpu"}
"""


def _done(db: str) -> int:
    try:
        study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{db}")
    except Exception:
        return 0
    return sum(1 for t in study.trials if t.state.is_finished())


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_ctrl_c_keeps_finished_trials_and_resume_continues(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(textwrap.dedent(CFG))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "autotune", "run", str(cfg), "--out", str(out), "--trials", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while _done(str(out / "study.db")) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "--resume" in output
    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{out / 'study.db'}")
    # Measured: guarded ("ok"), or stopped after one window far below the best so far.
    timed = ("ok", "stopped")
    finished = [t for t in study.trials if t.user_attrs.get("ran") and t.user_attrs.get("status") in timed]
    assert 2 <= len(finished) < 6
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    rows = (out / "trials.csv").read_text().strip().splitlines()
    assert len(rows) - 1 == len(study.trials)
    partial = json.loads((out / "best_config.json").read_text())
    assert partial["stop_reason"] == "interrupted"
    assert partial["speedup"]["method"] in ("trial ratio, not confirmed", "baseline is best")
    assert partial["speedup"]["verdict"] in ("unconfirmed", "none")

    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{out / 'study.db'}")
    measured = [t for t in study.trials if t.user_attrs.get("ran")]
    assert len([t for t in measured if t.user_attrs["status"] in timed]) == 6
    assert sum(t.user_attrs.get("baseline", False) for t in study.trials) == 1
    assert json.loads((out / "best_config.json").read_text())["n_trials"] == len(study.trials)
    assert os.path.getsize(out / "trials.csv") > 0


@pytest.mark.slow
def test_a_study_shared_by_two_kinds_of_hardware_keeps_them_apart(tmp_path, capsys):
    from autotune.cli import main
    from autotune.config import Config
    from autotune.search.status import study_status
    from autotune.search.storage import hardware_slug
    from autotune.search.study import open_study

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    space = {"base": None, "batch_size": [8, 16]}
    env, _, resolved = autotune.plan(MLP(), classification_data(), space=space, device="cpu", baseline_batch_size=8)
    # A group measured elsewhere, on hardware this machine is not: its trials as a worker there stores them.
    elsewhere = "Other GPU (sm90) x8, driver 1.0"
    other = open_study(url, "shared", ["throughput"], 0, False, hardware=elsewhere, env={"device": "cuda:0"})
    fast = {**resolved.baseline, "batch_size": 16}
    for number, (config, speed) in enumerate([(resolved.baseline, 100.0), (fast, 300.0)]):
        attrs = {"config": config, "key": Config(config).key(), "baseline": number == 0, "status": "ok", "ran": True}
        attrs.update(samples_per_s=speed, metric_drop=0.0, hardware=elsewhere, worker="elsewhere:1")
        other.add_trial(optuna.trial.create_trial(values=[speed], user_attrs=attrs))

    args = dict(space=space, baseline_batch_size=8, measure=FAST, n_trials=2, device="cpu", isolation="inprocess")
    args.update(storage=url, study_name="shared", export=(), out_dir=tmp_path / "out")
    with pytest.raises(autotune.ConfigError, match=r"already exists.*--join"):
        autotune.optimize(MLP(), classification_data(), **args)
    result = autotune.optimize(MLP(), classification_data(), join=True, **args)

    mine = env.hardware_key()
    assert result.study.study_name == f"shared@{hardware_slug(mine)}"
    assert {t.user_attrs["hardware"] for t in result.study.trials} == {mine}
    assert sum(t.user_attrs.get("ran", False) for t in result.study.trials) == 2  # its own budget, its own baseline
    saved = json.loads((tmp_path / "out" / "best_config.json").read_text())
    assert saved["study"]["hardware"] == mine and saved["baseline"]["samples_per_s"] != 100.0
    by_hardware = tmp_path / "out" / "by_hardware"
    assert json.loads((by_hardware / hardware_slug(mine) / "best_config.json").read_text()) == saved
    theirs = json.loads((by_hardware / hardware_slug(elsewhere) / "best_config.json").read_text())
    assert theirs["config"] == fast and theirs["env"] == {"device": "cuda:0"}
    assert theirs["speedup"]["method"] == "trial ratio, not confirmed" and theirs["speedup"]["speedup"] == 3.0
    assert theirs["speedup"]["verdict"] == "unconfirmed" and "other workers" in theirs["speedup"]["sentence"]
    assert (by_hardware / hardware_slug(elsewhere) / "trials.csv").exists()

    groups = {g["hardware"]: g for g in study_status(url, "shared")["groups"]}
    assert groups[elsewhere]["best"]["trial_ratio"] == 3.0 and groups[mine]["n_measured"] == 2
    assert main(["status", "--storage", url, "--study", "shared"]) == 0
    printed = capsys.readouterr().out
    assert elsewhere in printed and "elsewhere:1" in printed


def test_a_group_keeps_its_objectives(tmp_path):
    from autotune.search.study import open_study

    url = f"sqlite:///{tmp_path / 'study.db'}"
    open_study(url, "s", ["throughput"], 0, False, hardware="cpu x")
    with pytest.raises(autotune.ConfigError, match=r"optimizes \['maximize'\].*latency"):
        open_study(url, "s", ["latency"], 0, True, hardware="cpu x")


def test_resuming_with_another_space_says_how_to_fix_it(tmp_path):
    common = {"out_dir": tmp_path, "isolation": "inprocess", "export": (), "n_finalists": 0}
    common["measure"] = {"n_windows": 1, "window_s": 0.02, "warmup_batches": 1, "n_remeasure": 0}
    autotune.optimize(MLP(), classification_data(), space={"base": None, "batch_size": [8, 16]}, n_trials=2, **common)
    with pytest.raises(autotune.ConfigError, match=r"search space cannot change.*new study"):
        autotune.optimize(
            MLP(), classification_data(), space={"base": None, "batch_size": [8, 64]}, n_trials=4, resume=True, **common
        )


def test_a_trial_whose_process_died_is_failed_and_retried_at_once(tmp_path):
    """A run killed with SIGKILL leaves its trial RUNNING; on this host its dead process is
    recognised at once (not after the grace period) and its configuration is queued again."""
    import subprocess

    from autotune.report.summary import write_trials_csv
    from autotune.search.storage import fail_dead_local, open_storage, owner_attrs
    from autotune.search.study import trial_record

    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    study = optuna.create_study(storage=storage, study_name="s")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = {**owner_attrs(), "pid": dead.pid}
    trial = study.ask({"batch_size": optuna.distributions.CategoricalDistribution([8, 16])})
    for key, value in {**gone, "config": {"batch_size": trial.params["batch_size"]}}.items():
        trial.set_user_attr(key, value)
    alive = study.ask({"batch_size": optuna.distributions.CategoricalDistribution([8, 16])})
    for key, value in owner_attrs().items():  # this very process: alive, left alone
        alive.set_user_attr(key, value)
    # A trial read while its owner's stamp is half written (the pid, not yet its start time) is
    # being claimed, not dead: another worker once failed a live baseline that way.
    claiming = study.ask({"batch_size": optuna.distributions.CategoricalDistribution([8, 16])})
    for key, value in {**gone, "pid": os.getpid()}.items():
        if key != "pid_started":
            claiming.set_user_attr(key, value)
    # Before: the dead trial has no status, and trials.csv still gives it one.
    write_trials_csv(tmp_path / "trials.csv", [trial_record(t) for t in study.trials])
    rows = (tmp_path / "trials.csv").read_text().splitlines()[1:]
    assert all(row.split(",")[1] == "running" for row in rows)

    assert fail_dead_local(study) == [trial.number]
    frozen = study.trials[trial.number]
    assert frozen.state == optuna.trial.TrialState.FAIL and frozen.user_attrs["status"] == "interrupted"
    assert "ended while it ran" in frozen.user_attrs["reason"]
    assert study.trials[alive.number].state == optuna.trial.TrialState.RUNNING
    assert study.trials[claiming.number].state == optuna.trial.TrialState.RUNNING
    retry = [t for t in study.trials if t.state == optuna.trial.TrialState.WAITING]
    assert len(retry) == 1 and retry[0].params == trial.params
    assert retry[0].system_attrs["failed_trial"] == trial.number  # as Optuna's own retry names it


def test_a_combination_that_failed_twice_is_not_run_a_third_time():
    import optuna

    from autotune.search.study import _fault_rule

    study = optuna.create_study(storage="sqlite:///:memory:")
    base = {"runtime": "torchscript", "quantization": "int8_static", "compile_mode": "none", "compile_dynamic": False}
    for number, batch in enumerate((16, 64)):
        trial = study.ask()
        for key, value in {"status": "error", "kind": "runtime", "config": {**base, "batch_size": batch}}.items():
            trial.set_user_attr(key, value)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        if number == 0:  # one failure may be the batch's own
            assert _fault_rule({**base, "batch_size": 128}, study.trials) is None
    why = _fault_rule({**base, "batch_size": 128}, study.trials)
    assert why is not None and "trials 0, 1 failed (runtime)" in why
    assert _fault_rule({**base, "quantization": "int8_dynamic", "batch_size": 128}, study.trials) is None


def test_a_code_path_that_failed_three_times_is_not_run_with_other_paddings_or_fallbacks():
    import optuna

    from autotune.search.study import _fault_rule

    study = optuna.create_study(storage="sqlite:///:memory:")
    path = {"runtime": "torchscript", "quantization": "int8_static", "compile_mode": "none"}
    varied = [
        {"padding": "trim", "int8_fallback": 2},
        {"padding": "trim_8", "int8_fallback": 8},
        {"padding": "trim_16"},
    ]
    for number, changes in enumerate(varied):
        if number == 2:  # two failures of different paddings and fallbacks may be theirs
            assert _fault_rule({**path, "padding": "as_given", "int8_fallback": 4}, study.trials) is None
        trial = study.ask()
        for key, value in {"status": "error", "kind": "runtime", "config": {**path, **changes}}.items():
            trial.set_user_attr(key, value)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    why = _fault_rule({**path, "padding": "as_given", "int8_fallback": 4}, study.trials)
    assert why is not None and "trials 0, 1, 2 failed (runtime)" in why
    assert _fault_rule({**path, "runtime": "torch"}, study.trials) is None


def test_a_failing_configuration_is_told_as_pruned_so_the_sampler_learns_from_it():
    """TPE ignores failed trials and samples pruned ones as the worst: a configuration that
    errs is pruned; a trial that was skipped or cut by the study's deadline is failed."""
    import optuna

    from autotune.search.study import _tell
    from autotune.trial.spec import TrialResult

    study = optuna.create_study(storage="sqlite:///:memory:", directions=["maximize"])
    outcomes = {
        "error": TrialResult("error", "runtime", "RuntimeError: no kernel", {}),
        "oom": TrialResult("oom", "oom", "out of memory", {}),
        "unsupported": TrialResult("infeasible", "unsupported", "int8 fallback: keeping 2 layers float fails", {}),
        "deadline": TrialResult("timeout", "deadline", "stopped at the study's deadline", {}),
        "skipped": TrialResult("skipped", None, "not run: the budget is taken", {}),
    }
    states = {name: _tell(study, study.ask(), o, ["throughput"], 0.01).state for name, o in outcomes.items()}
    pruned, failed = optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL
    assert states == {"error": pruned, "oom": pruned, "unsupported": pruned, "deadline": failed, "skipped": failed}


def test_a_lever_refused_for_time_is_queued_again_once_its_price_fits():
    """A budget's first OpenVINO trial of real MiniLM was refused at 54 s (priced 56 s) and never
    came back, though the next 54 s went to trials at 0.4-0.7x of the best. Once its price fits
    in what the search has left, a refused trial is queued again, first, and only once."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    from autotune.search.limits import requeue_refused

    study = optuna.create_study()
    dist = {"runtime": CategoricalDistribution(["torch", "openvino"])}

    def add(runtime, **attrs):
        state = TrialState.COMPLETE if attrs.get("status") == "ok" else TrialState.FAIL
        study.add_trial(create_trial(params={"runtime": runtime}, distributions=dist, state=state,
                                     value=1.0 if state == TrialState.COMPLETE else None,
                                     user_attrs={"key": runtime, "config": {"runtime": runtime}, **attrs}))  # fmt: skip

    add("torch", status="ok", ran=True, baseline=True)
    add("openvino", status="timeout", kind="deadline", ran=False, phase="screen")

    class Limits:
        fits = False

        def too_late(self, config, finished):
            return None if self.fits else "not started: it would take about 56 s"

    limits = Limits()
    assert not requeue_refused(study, limits)  # still too dear: left as it is
    limits.fits = True
    assert requeue_refused(study, limits)
    queued = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.WAITING]
    assert [(t.system_attrs["fixed_params"], t.user_attrs["requeue_of"], t.user_attrs["phase"]) for t in queued] == [
        ({"runtime": "openvino"}, 1, "screen")
    ]
    assert not requeue_refused(study, limits)  # queued once, not again
