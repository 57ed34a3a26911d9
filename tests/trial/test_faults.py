"""Real faults in real worker processes: a hang, a process that kills itself, an out-of-memory
error, NaN outputs. Each is recorded with its kind, the worker is replaced, the study goes on."""

import csv

import pytest

import autotune
from tests.models import MLP, HangAt, KillAt, NanUnderAutocast, OomAt, classification_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}


def _optimize(model, tmp_path, space, **kw):
    options = dict(
        space=space,
        out_dir=tmp_path,
        baseline_batch_size=8,
        n_val=32,
        measure=FAST,
        n_verify_pairs=1,
        n_trials=len(space.get("batch_size", [0, 0])),
        device="cpu",
    )
    options.update(kw)
    return autotune.optimize(model, classification_data(), **options)


def _by_batch(result):
    return {t.user_attrs["config"]["batch_size"]: t.user_attrs for t in result.study.trials if "config" in t.user_attrs}


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_hang_is_a_timeout_and_the_study_goes_on(tmp_path):
    result = _optimize(HangAt(16), tmp_path, {"base": None, "batch_size": [8, 16, 32]}, trial_timeout=8, n_trials=3)
    trials = _by_batch(result)
    assert trials[16]["status"] == "timeout"
    assert "killed" in trials[16]["reason"]
    assert trials[32]["status"] == "ok"  # measured by a fresh worker after the kill
    assert result.best_config["batch_size"] in (8, 32)


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_worker_that_kills_itself_is_a_crash(tmp_path):
    result = _optimize(KillAt(16), tmp_path, {"base": None, "batch_size": [8, 16, 32]}, n_trials=3)
    trials = _by_batch(result)
    assert trials[16]["status"] == "crash"
    assert "SIGKILL" in trials[16]["reason"]
    assert trials[32]["status"] == "ok"
    rows = list(csv.DictReader(open(tmp_path / "trials.csv")))
    assert {"crash", "ok"} <= {r["status"] for r in rows}


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_out_of_memory_marks_larger_batches_infeasible_without_running_them(tmp_path):
    result = _optimize(OomAt(16), tmp_path, {"base": None, "batch_size": [8, 16, 32, 64]}, n_trials=4)
    trials = _by_batch(result)
    assert trials[16]["status"] == "oom" and trials[16]["kind"] == "oom"
    for size in (32, 64):
        if size in trials:  # the sampler may reach them in either order; if it did, the rule held
            assert trials[size]["status"] == "oom"
            assert trials[size]["kind"] in ("oom", "oom-rule")
    ruled = [t for t in trials.values() if t["kind"] == "oom-rule"]
    assert ruled and all(not t["ran"] and "ran out of memory in trial" in t["reason"] for t in ruled)
    assert result.best_config["batch_size"] == 8


def test_nan_outputs_make_a_candidate_infeasible(tmp_path, cpu_env):
    if not cpu_env.bf16:
        pytest.skip("bfloat16 autocast is not offered on this CPU")
    # Without the early stop: bf16 on this small MLP can run under 75% of float32, and a trial
    # stopped for its speed is not guarded (it is not a contender either way).
    measure = {**FAST, "stop_share": 0.0}
    space = {"base": None, "amp_dtype": ["float32", "bfloat16"]}
    result = _optimize(NanUnderAutocast(), tmp_path, space, n_trials=2, measure=measure)
    bf16 = [t.user_attrs for t in result.study.trials if t.user_attrs.get("config", {}).get("amp_dtype") == "bfloat16"]
    assert bf16 and bf16[0]["status"] == "infeasible" and bf16[0]["kind"] == "nan"
    assert result.best_config["amp_dtype"] == "float32"


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_inprocess_isolation_runs_without_a_worker(tmp_path):
    result = _optimize(MLP(), tmp_path, {"base": None, "batch_size": [8, 16]}, isolation="inprocess")
    assert {t.user_attrs["status"] for t in result.study.trials} == {"ok"}
    assert result.speedup > 0


@pytest.mark.slow  # CI time: tests/run/test_deadline.py bounds a run by its timeout
def test_the_study_timeout_stops_a_hanging_trial_on_time(tmp_path):
    """No trial_timeout: the adaptive limit (at least 30 s) would outlive a 12 s study, so the
    deadline stops the hanging trial, which is recorded, and the run still names a winner."""
    import time

    started = time.monotonic()
    result = _optimize(HangAt(16), tmp_path, {"base": None, "batch_size": [8, 16, 32]}, timeout=12, n_trials=3)
    elapsed = time.monotonic() - started
    trials = _by_batch(result)
    if 16 in trials:  # the sampler reached the hanging configuration before the deadline
        assert trials[16]["status"] == "timeout" and trials[16]["kind"] == "deadline"
        assert "study's deadline" in trials[16]["reason"]
    assert result.stop_reason in ("timeout", "n_trials")
    assert result.best_config["batch_size"] in (8, 32)
    # Worker starts, the baseline, the rounds and the reports: well within a minute past the deadline.
    assert elapsed < 12 + 90, f"the run took {elapsed:.0f} s"
    rows = list(csv.DictReader(open(tmp_path / "trials.csv")))
    assert all(r["status"] for r in rows), "a trial was left with a blank row"


def test_the_adaptive_trial_limit_follows_the_baseline():
    from autotune.search.study import COMPILE_ALLOWANCE_S, FIRST_TRIAL_TIMEOUT_S, TIMEOUT_FLOOR_S, trial_limit

    base = {"config": {"compile_mode": "none", "batch_size": 8}, "wall_s": 2.0}
    assert trial_limit({"compile_mode": "none"}, None, None) == FIRST_TRIAL_TIMEOUT_S
    assert trial_limit({"compile_mode": "none", "batch_size": 64}, base, None) == TIMEOUT_FLOOR_S
    assert trial_limit({"compile_mode": "none"}, {**base, "wall_s": 10.0}, None) == 100.0
    assert trial_limit({"compile_mode": "default"}, base, None) == TIMEOUT_FLOOR_S + COMPILE_ALLOWANCE_S
    assert trial_limit({"compile_mode": "default"}, base, 7.0) == 7.0  # the user's own limit stands


def test_a_forward_that_returns_none_is_bad_input(tmp_path):
    from tests.models import ReturnsNone

    with pytest.raises(autotune.InputError, match=r"returned None, with no tensor in it"):
        _optimize(ReturnsNone(), tmp_path, {"base": None, "batch_size": [8, 16]})


@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_a_worker_whose_parent_is_killed_ends_with_it(tmp_path, fork):
    """The worker runs in a session of its own, so a killed parent (a test at its timeout, a
    user's kill -9) used to leave a worker busy in a trial running, holding the GPU: now it
    ends itself. (An idle worker always ended: its next read of the pipe fails.) A worker
    forked from the run's fork server ends with the server, which ends with the parent. The run's
    scratch folder, which its runner no longer can remove, goes with the worker."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent(f"""
        import os, sys, time
        from autotune.config import Config
        from autotune.trial.measure import MeasureSettings
        from autotune.trial.runner import SubprocessRunner, pickle_spec
        from autotune.trial.spec import WorkerSpec
        from tests.models import HangAt, classification_data

        spec = WorkerSpec(model=HangAt(16), dataset=classification_data(32), metric=None, device="cpu",
                          baseline=dict(Config({{"batch_size": 8}})), val_indices=list(range(8)),
                          measure=MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1))
        runner = SubprocessRunner(pickle_spec(spec), 120.0, __import__("pathlib").Path({str(tmp_path)!r}) / "w.log",
                                  fork={fork})
        if {fork}:
            runner.restart()  # the worker now is a fork of the server
            assert runner._proc.pid != os.getpid() and os.getppid() != runner._proc.pid
        print(runner._proc.pid, runner._scratch.path, flush=True)
        runner.run(dict(Config({{"batch_size": 16}})), timeout=600)  # the worker hangs in this trial
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pid, scratch = parent.stdout.readline().split()
        worker = int(pid)
        os.kill(worker, 0)  # alive while its parent is
        time.sleep(2)  # the trial has started and hangs
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(worker, signal.SIGKILL)
            pytest.fail("the worker outlived its killed parent by 30 s")
        assert not os.path.exists(scratch)  # the run's files: the worker removed them, its runner could not
    finally:
        if parent.poll() is None:
            parent.kill()
