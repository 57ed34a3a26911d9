"""A run's ``timeout`` bounds the whole run, and an in-process trial its ``trial_timeout``."""

import json
import time

import pytest
import torch

from autotune.config import Config
from autotune.errors import TrialError
from autotune.run.stages import overrun_margin
from autotune.trial.inprocess import InProcessRunner
from autotune.trial.measure import MeasureSettings
from autotune.trial.spec import WorkerSpec
from tests.models import MLP, HangAt, classification_data

FAST = MeasureSettings(n_windows=2, window_s=0.03, warmup_batches=1)


class _SlowCalls(MLP):
    """An MLP with a fixed cost per call (sleeping, so the time is the same on a busy machine):
    every measurement, round and export takes real time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return super().forward(x)


def test_an_in_process_trial_stops_at_its_timeout():
    spec = WorkerSpec(
        model=HangAt(16),
        dataset=classification_data(64),
        metric=None,
        device="cpu",
        baseline=dict(Config({"batch_size": 8})),
        val_indices=list(range(16)),
        measure=MeasureSettings(n_windows=2, window_s=0.03, warmup_batches=1),
    )
    runner = InProcessRunner(spec)
    started = time.monotonic()
    hung = runner.run(dict(Config({"batch_size": 16})), timeout=2.0)
    assert hung.status == "timeout" and "2 s" in hung.reason
    assert time.monotonic() - started < 60  # the model sleeps an hour: it was interrupted
    # The runner goes on: the next configuration is measured as usual.
    assert runner.run(dict(Config({"batch_size": 8})), timeout=60.0).status == "ok"


def test_the_timeout_bounds_the_whole_run(tmp_path):
    """Before, the search alone took ``timeout`` (after starting the worker); the rounds after it
    20 s more, held-out scoring and export as long as they needed (here about 25 s). Now all of
    it ends within the stated margin."""
    import autotune

    timeout = 20.0
    started = time.monotonic()
    result = autotune.optimize(
        _SlowCalls(),
        classification_data(128),
        space={"base": None, "batch_size": [8, 16, 32, 64]},
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=50,
        timeout=timeout,
        # Scoring it takes at least 2 x 313 calls of 50 ms (31 s, at batch 64) and up to 2 x 2,500
        # (at batch 8): longer than the whole run may take, whenever the search ends, so it must be
        # cut off. (With 2,000 samples it fitted whenever the search ran out of batch sizes early.)
        test_dataset=classification_data(20000, seed=1),
        out_dir=tmp_path,
        device="cpu",
        isolation="inprocess",
        export=("torchscript",),
    )
    elapsed = time.monotonic() - started
    assert result.stop_reason in ("timeout", "exhausted")
    assert elapsed <= timeout + overrun_margin(timeout), elapsed
    assert (tmp_path / "best_config.json").is_file()
    # What did not fit says so: the held-out scoring was cut off at the deadline.
    assert "error" in result.held_out, result.held_out


def _spec(model=None, n=64):
    return WorkerSpec(
        model=model if model is not None else MLP(),
        dataset=classification_data(n),
        metric=None,
        device="cpu",
        baseline=dict(Config({"batch_size": 8})),
        val_indices=list(range(16)),
        measure=MeasureSettings(n_windows=2, window_s=0.03, warmup_batches=1),
    )


def test_a_trial_past_the_deadline_is_not_started_and_says_so():
    """Before, a worker's start and a trial got "one second at least" past the deadline: a
    trial started with nothing left was killed and measured nothing."""
    runner = InProcessRunner(_spec())
    runner.deadline = time.monotonic() - 1.0
    result = runner.run(dict(Config({"batch_size": 16})), timeout=60.0)
    assert result.status == "timeout" and result.kind == "deadline"
    assert result.metrics["ran"] is False and "not started" in result.reason
    with pytest.raises(TrialError) as raised:
        runner.call("rounds", [dict(Config({"batch_size": 8}))], 1, 1)
    assert raised.value.kind == "deadline"


def test_a_worker_start_that_cannot_be_ready_before_the_deadline_is_not_begun(tmp_path):
    from autotune.trial.runner import SubprocessRunner, pickle_spec

    runner = SubprocessRunner(pickle_spec(_spec()), 120.0, tmp_path / "worker.log")
    try:
        assert runner.start_s is not None and runner.start_s > 0  # the first start was timed
        runner.deadline = time.monotonic() + runner.start_s / 4
        starts = runner.n_starts
        with pytest.raises(TrialError) as raised:
            runner.restart()
        assert raised.value.kind == "deadline" and "not started" in str(raised.value)
        assert runner.n_starts == starts  # no process was begun
        result = runner.run(dict(Config({"batch_size": 8})))
        assert result.status == "timeout" and result.kind == "deadline" and result.metrics["ran"] is False
    finally:
        runner.deadline = None
        runner.close()


def test_a_confirmation_the_deadline_leaves_no_time_for_is_unconfirmed_and_keeps_the_best():
    """Before, a deadline that cut the confirmation off was reported as "failed", with no claim."""
    from autotune.run.output import _claim_fields
    from autotune.run.rounds import claim_speedup

    baseline = {"number": 0, "key": "a", "samples_per_s": 100.0, "config": dict(Config({"batch_size": 8}))}
    pick = {"number": 3, "key": "b", "samples_per_s": 180.0, "config": dict(Config({"batch_size": 32}))}
    runner = InProcessRunner(_spec())
    # Too little left for the least confirmation's predicted cost: nothing runs.
    best, confirmed, table = claim_speedup(runner, baseline, [pick], 3, True, FAST, budget_s=4.0, need_s=12.0)
    assert best is pick and confirmed is None and table[0]["deadline"]
    # The deadline cuts the rounds off in the worker.
    runner.deadline = time.monotonic() - 1.0
    best, confirmed, table = claim_speedup(runner, baseline, [pick], 3, True, FAST, budget_s=30.0)
    assert best is pick and confirmed is None and table[0].get("deadline") and not table[0].get("failed")
    fields = _claim_fields(baseline, pick, None, False, f"deadline ({table[0]['error']})")
    assert fields["verdict"] == "unconfirmed" and fields["speedup"] == pytest.approx(1.8)
    assert "unconfirmed: deadline" in fields["sentence"] and fields["why"] == "deadline"


def test_a_compile_trial_that_cannot_finish_before_the_deadline_is_not_started(tmp_path):
    """A compile whose predicted cost (no compile measured yet: at least 15 s) does not fit in
    what the search has left is recorded as not started; the cheap trials still run, and the
    run ends with its best confirmed or said unconfirmed, never failed."""
    import autotune

    result = autotune.optimize(
        MLP(),
        classification_data(128),
        space={"base": None, "batch_size": [8, 16, 32], "compile_mode": ["none", "default"]},
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=6,
        timeout=15.0,
        out_dir=tmp_path,
        device="cpu",
        isolation="inprocess",
        export=(),
        profile=False,
    )
    records = [t.user_attrs for t in result.study.trials]
    compiled = [r for r in records if r.get("config", {}).get("compile_mode") == "default"]
    assert compiled and not any(r.get("ran") for r in compiled), compiled
    late = [r for r in compiled if r["kind"] == "deadline"]
    assert late and all("not started" in r["reason"] for r in late)
    assert any(r.get("ran") and not r.get("baseline") for r in records)  # cheap trials ran
    assert result.verdict != "failed"


class _SlowBuild(MLP):
    """An MLP whose every build (a fresh copy in the worker) takes 2 s, as a compile does."""

    def __setstate__(self, state):
        super().__setstate__(state)
        time.sleep(2.0)


@pytest.mark.slow  # a 40 s run; the arithmetic is tested fast in tests/search/test_cost.py
def test_a_budget_run_ends_within_a_tenth_of_its_budget_with_a_confirmed_pick(tmp_path):
    """Every build costs 2 s: a search that ran to the deadline (or a fixed quarter kept for the
    finish) left the confirmation's builds no time. The finish is priced from the measured builds,
    and the whole run, report included, ends within 10% of the budget."""
    import autotune

    budget = 40.0
    started = time.monotonic()
    result = autotune.optimize(
        _SlowBuild(),
        classification_data(256),
        space={"base": None, "batch_size": [8, 16, 32, 64, 128]},
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.1, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=50,
        budget="40s",
        out_dir=tmp_path,
        device="cpu",
        isolation="inprocess",
        export=("torchscript",),
    )
    elapsed = time.monotonic() - started
    assert elapsed <= 1.1 * budget, elapsed
    assert result.stop_reason in ("budget", "converged", "exhausted")
    assert result.verdict not in ("unconfirmed", "failed"), result.claim  # the pick was confirmed
    saved = (tmp_path / "best_config.json").read_text()
    assert json.loads(saved)["speedup"]["n_rounds"] >= 2
    assert '"finish"' in saved and "confirmation" in saved  # the finish's phases with their seconds


def test_a_budget_is_a_duration_and_a_bad_one_says_how_to_write_it():
    from autotune.errors import ConfigError
    from autotune.run.options import Options

    assert Options(budget="5m").limit_s == 300.0 and Options(budget=90, timeout=60).limit_s == 60
    with pytest.raises(ConfigError, match="90s, 5m, 1h30m"):
        Options(budget="five minutes")


def test_a_long_timeout_gives_the_rounds_a_share_of_the_run_not_all_it_left():
    from autotune.run.finish import rounds_budget

    assert rounds_budget(1000.0, 20.0, 500.0) == 125.0  # a quarter of a 500 s search, not 1000 s
    assert rounds_budget(1000.0, 20.0, 40.0) == 60.0  # a short search still gets a minute
    assert rounds_budget(1000.0, 100.0, 40.0) == 150.0  # and always 1.5x the least confirmation
    assert rounds_budget(30.0, 20.0, 500.0) == 30.0  # the deadline comes first


def test_a_finalist_costly_to_build_keeps_its_trial_figure_and_is_not_built_again():
    """Two static compiles of trimmed text (75 and 87 s to rebuild) made 170 s of a 277-s
    finish and were not picked: after a 585-s search a finalist may take 58 s to build."""
    from autotune.run.finish import worth_selecting

    leader, costly, cheap = ({"number": n, "compile_s": s} for n, s in ((7, 40.6), (5, 74.7), (9, 12.1)))
    kept, left = worth_selecting([leader, costly, cheap], 585.0)
    assert [f["number"] for f in kept] == [7, 9]
    assert left[0]["trial"] == 5 and "75 s" in left[0]["not_selected"] and "58 s" in left[0]["not_selected"]
    # The fastest is the pick's candidate whatever its build costs; a short run keeps 5 s for each.
    kept, left = worth_selecting([{"number": 1, "compile_s": 300.0}, {"number": 2, "compile_s": 4.0}], 30.0)
    assert [f["number"] for f in kept] == [1, 2] and not left
    # A two-minute search: a compiled finalist (16 s) keeps its trial's figure, an eager one is built.
    finalists = [{"number": 14, "compile_s": 2.5}, {"number": 8, "compile_s": 1.9}, {"number": 6, "compile_s": 16.4}]
    kept, left = worth_selecting(finalists, 124.0)
    assert [f["number"] for f in kept] == [14, 8] and [row["trial"] for row in left] == [6]


@pytest.mark.slow  # CI time: two confirmations of 30 s budgets
def test_a_budget_that_holds_one_least_confirmation_but_not_two_confirms_in_one_process(monkeypatch):
    """A 3-minute budget split its confirmation over two processes: the first had 8 s for its
    rounds, none ended, and the claim was "unconfirmed"; in one fresh process, the worker's start
    took most of the 60 s. Under twice the least confirmation's cost the rounds run in the
    search's own worker; with room for two, in two fresh ones."""
    import autotune.run.rounds as result

    asked = []
    real = result._process_rounds

    def counting(runner, configs, n_min, n_max, n_processes, **kw):
        asked.append((n_processes, kw.get("fresh", True), n_min, kw["diagnose"]))
        return real(runner, configs, n_min, n_max, n_processes, **kw)

    monkeypatch.setattr(result, "_process_rounds", counting)
    baseline = {"number": 0, "key": "a", "samples_per_s": 100.0, "config": dict(Config({"batch_size": 8}))}
    pick = {"number": 3, "key": "b", "samples_per_s": 180.0, "config": dict(Config({"batch_size": 32}))}
    runner = InProcessRunner(_spec())
    result.claim_speedup(runner, baseline, [pick], 3, True, FAST, budget_s=30.0, need_s=20.0)
    result.claim_speedup(runner, baseline, [pick], 3, True, FAST, budget_s=30.0, need_s=10.0)
    # In one process: the least rounds a claim is made from, without the loader and the model
    # timed apart (with them, 3 rounds of real MiniLM outran a 60-s confirmation: no claim).
    assert asked == [(1, False, 2, False), (2, True, 3, True)]


def test_rounds_the_deadline_would_cut_short_come_back_with_what_they_timed():
    """A budget's confirmation asked for more rounds than its 60 s held: the worker was stopped
    at the deadline mid-round and the rounds it had timed were lost with it. Now it begins no
    round that would end past the deadline, even short of the least asked for."""
    runner = InProcessRunner(_spec(_SlowCalls()))
    configs = [dict(Config({"batch_size": 8})), dict(Config({"batch_size": 16}))]
    assert len(_reply(runner, configs, 1)["rounds"]) == 1  # built and timed once
    # What a warm round costs (the builds are kept): priced from the first call, its build
    # included, a slow build on a busy CI machine left room for all 30.
    started = time.monotonic()
    assert len(_reply(runner, configs, 1)["rounds"]) == 1
    round_s = time.monotonic() - started
    runner.deadline = time.monotonic() + 1.0 + 6 * round_s
    rounds = _reply(runner, configs, 30)["rounds"]
    assert 2 <= len(rounds) < 30 and time.monotonic() < runner.deadline
    assert all(r[0]["samples_per_s"] > 0 and r[1]["samples_per_s"] > 0 for r in rounds)
    # Without a deadline nothing changes: the least rounds asked for are timed.
    runner.deadline = None
    assert len(_reply(runner, configs, 3)["rounds"]) == 3


def test_rounds_after_a_killed_worker_count_their_time_from_its_new_start(tmp_path):
    """A search's last trial killed at its deadline leaves no worker: the confirmation's rounds
    start a new one, and were told the time left before it started. Told 6.5 s, the
    quickstart's rounds ran past the deadline and were killed with nothing timed."""
    from autotune.trial.runner import SubprocessRunner, pickle_spec

    runner = SubprocessRunner(pickle_spec(_spec(_SlowCalls())), 120.0, tmp_path / "worker.log")
    configs = [dict(Config({"batch_size": 8})), dict(Config({"batch_size": 16}))]
    try:
        killed = runner.run(configs[1], timeout=0.01)  # cut off: its worker is killed
        assert killed.status == "timeout"
        # Time for the new worker's start and a few rounds, not for the start twice over.
        runner.deadline = time.monotonic() + runner.start_s + 4.0
        rounds = _reply(runner, configs, 30)["rounds"]
        assert rounds and time.monotonic() < runner.deadline
    finally:
        runner.deadline = None
        runner.close()


def _reply(runner, configs, n_min):
    from autotune.run.rounds import _rounds_reply

    return _rounds_reply(runner, configs, n_min, n_min)


def test_a_budget_that_holds_the_confirmation_but_not_a_selection_confirms_the_fastest_trial(monkeypatch):
    """A 3-minute budget's selection among two finalists took 50 of its 61 s: the confirmation
    was killed with nothing timed, and the run claimed nothing. Where two selection rounds and
    the least confirmation do not both fit, the fastest trial is confirmed alone."""
    import autotune.run.rounds as result

    measured = []
    real = result._rounds_reply

    def counting(runner, configs, n_min, n_max, **kw):
        measured.append([c["batch_size"] for c in configs])
        return real(runner, configs, n_min, n_max, **kw)

    monkeypatch.setattr(result, "_rounds_reply", counting)
    # Each trial's measurement cost 5 s (its figures as the study recorded them).
    cost = {"wall_s": 6.0, "timed_s": 4.0, "compile_s": 0.5}
    baseline = {"number": 0, "key": "a", "samples_per_s": 100.0, "config": dict(Config({"batch_size": 8})), **cost}
    fast = {"number": 3, "key": "b", "samples_per_s": 180.0, "config": dict(Config({"batch_size": 32})), **cost}
    close = {"number": 5, "key": "c", "samples_per_s": 175.0, "config": dict(Config({"batch_size": 16})), **cost}
    runner = InProcessRunner(_spec())
    # Two rounds of the two finalists (23 s with their builds) and a confirmation (20 s) do not
    # fit in 40 s: no selection.
    _, confirmed, table = result.claim_speedup(runner, baseline, [fast, close], 3, True, FAST, budget_s=40.0,
                                                  need_s=20.0)  # fmt: skip
    assert measured and all(c == [8, 32] for c in measured)  # the baseline and the pick: no selection
    assert confirmed is not None and confirmed["claim"]["n_rounds"] >= 2
    assert [row["trial"] for row in table] == [3, 5] and "fastest trial was confirmed" in table[1]["not_selected"]
    # With room for both, the finalists are selected first.
    measured.clear()
    result.claim_speedup(runner, baseline, [fast, close], 3, True, FAST, budget_s=60.0, need_s=20.0)
    assert measured[0] == [32, 16]


def test_while_nothing_beats_the_baseline_the_finish_keeps_only_the_exports_time():
    """A 90-s budget of real text refused its recipe for the confirmation it would need, and
    ended at 52 s with the baseline: with nothing to confirm, the search keeps only what the
    export and the reports need; once a candidate beats the baseline, its confirmation too."""
    from types import SimpleNamespace

    from autotune.run.finish import REPORT_S, finish_reserve
    from autotune.search.cost import export_s

    run = SimpleNamespace(
        runners=[SimpleNamespace(restarts=True, start_s=3.0)],
        options=SimpleNamespace(export=("onnx",), train=False, limit_s=90.0),
    )
    trial = {"status": "ok", "wall_s": 12.0, "timed_s": 4.0, "compile_s": 0.5, "guard_s": 3.0, "config": {}}
    base = {**trial, "baseline": True, "samples_per_s": 100.0}
    slower, faster = {**trial, "samples_per_s": 80.0}, {**trial, "samples_per_s": 300.0}
    assert finish_reserve(run, [base]) == finish_reserve(run, [base, slower]) == export_s(base) + REPORT_S
    assert finish_reserve(run, [base, slower, faster]) > export_s(base) + REPORT_S + 10.0


def test_under_a_time_limit_a_noisy_trial_is_measured_again_once_unless_the_user_says():
    """Three measurements of a noisy baseline and of OpenVINO's float build took 55 s of a
    3-minute budget, and OpenVINO bf16 was refused for 2 s."""
    from autotune.run.options import Options

    assert Options(n_trials=8).timing().n_remeasure == 2
    assert Options(budget="3m").timing().n_remeasure == 1 and Options(timeout=60).timing().n_remeasure == 1
    assert Options(budget="3m", measure={"n_remeasure": 2}).timing().n_remeasure == 2
