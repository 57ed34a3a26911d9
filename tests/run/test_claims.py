"""The claim: selection and confirmation rounds, their statistics and verdicts, and candidates
measured with nothing left behind by another."""

import json
import math
import weakref

import pytest
import torch

from autotune._pristine import restore, snapshot
from autotune.config import Config
from autotune.run.claims import CONFIRM_DRAWS, MAX_CLAIM_WIDTH, geomean, half_width, interval, judge
from autotune.run.output import _claim_fields
from autotune.run.rounds import claim_speedup
from autotune.trial.inference import TrialContext
from autotune.trial.inprocess import InProcessRunner
from autotune.trial.measure import MeasureSettings
from autotune.trial.spec import WorkerSpec
from tests.models import MLP, StateProbe, classification_data

FAST = MeasureSettings(n_windows=2, window_s=0.03, warmup_batches=1)


def _context(model, **kw) -> TrialContext:
    spec = WorkerSpec(
        model=model,
        dataset=classification_data(128),
        metric=None,
        device="cpu",
        baseline=dict(Config({"batch_size": 8})),
        val_indices=list(range(16)),
        measure=kw.pop("measure", FAST),
        **kw,
    )
    return TrialContext(spec)


def test_interval_is_the_geometric_mean_with_a_t_interval():
    mid, lo, hi = interval([1.9, 2.0, 2.1, 2.0, 2.0])
    assert mid == pytest.approx(geomean([1.9, 2.0, 2.1, 2.0, 2.0]))
    assert lo < mid < hi and hi / lo < 1.1
    # One round proves nothing; more agreeing rounds narrow the interval.
    assert interval([2.0]) == (2.0, 0.0, math.inf)
    assert half_width([2.0, 2.1, 1.9] * 4) < half_width([2.0, 2.1, 1.9])


def test_judge_says_speedup_none_or_noisy():
    assert judge([1.50, 1.52, 1.49, 1.51, 1.50], 0.01, 0.10)["verdict"] == "speedup"
    # An interval that includes 1.0 is no measurable speedup, whatever the median says.
    none = judge([1.3, 0.8, 1.2, 0.9, 1.1], 0.0, 0.10)
    assert none["verdict"] == "none" and none["low"] <= 1.0 <= none["high"]
    assert "no measurable speedup" in none["sentence"]
    # Busy machine: other processes used the CPU during the rounds.
    busy = judge([3.0, 3.1, 2.9, 3.0, 3.05], 0.45, 0.10)
    assert busy["verdict"] == "noisy" and "45% of the CPU" in busy["sentence"]
    # Rounds that disagree on a quiet machine, every one of them a speedup (CRAFT over page
    # scans): the interval lies above 1.0, so the speedup stands, marked wide, with its least.
    wide = judge([4.84, 5.68, 6.13], 0.0, 0.10)
    assert wide["verdict"] == "speedup" and wide["wide"] and half_width([4.84, 5.68, 6.13]) > MAX_CLAIM_WIDTH
    assert wide["sentence"].endswith(f"the rounds disagree, so the speedup is at least {wide['low']:.2f}x")
    assert not judge([1.50, 1.52, 1.49, 1.51, 1.50], 0.01, 0.10)["wide"]
    # Disagreeing rounds whose interval reaches 1.0 are no measurable speedup.
    assert judge([1.5, 4.0, 2.0, 6.0, 0.7], 0.0, 0.10)["verdict"] == "none"
    # The same wide rounds beside busy processes: no claim.
    assert judge([4.84, 5.68, 6.13], 0.45, 0.10)["verdict"] == "noisy"


def test_an_interval_wholly_below_one_is_slower_never_a_speedup():
    slower = judge([0.95, 0.94, 0.96, 0.95, 0.95], 0.0, 0.10)
    assert slower["verdict"] == "slower" and slower["high"] < 1.0
    assert "slower than the baseline" in slower["sentence"]
    # Load or spread do not turn a measured slowdown into "noisy": it stays slower.
    assert judge([0.5, 0.52, 0.49, 0.5, 0.51], 0.45, 0.10)["verdict"] == "slower"
    assert judge([0.2, 0.5, 0.3, 0.6, 0.25], 0.0, 0.10)["verdict"] == "slower"
    # Just touching 1.0 is no measurable difference either way.
    assert judge([0.9, 1.1, 0.95, 1.05, 1.0], 0.0, 0.10)["verdict"] == "none"


def test_rounds_alternate_their_order():
    ctx = _context(StateProbe())
    StateProbe.log.clear()
    configs = [dict(Config({"batch_size": 8})), dict(Config({"batch_size": 16}))]
    out = ctx.rounds(configs, 3, 3)
    assert len(out["rounds"]) == 3 and all(len(r) == 2 for r in out["rounds"])
    # Batches seen, collapsed into runs: 8, 16 | 16, 8 | 8, 16 gives four runs (a fixed order,
    # 8, 16 | 8, 16 | 8, 16, would give six).
    runs = [e["batch"] for i, e in enumerate(StateProbe.log) if i == 0 or StateProbe.log[i - 1]["batch"] != e["batch"]]
    assert runs == [8, 16, 8, 16]


def test_confirmation_rounds_stop_once_the_interval_is_tight():
    ctx = _context(MLP())
    same = dict(Config({"batch_size": 8}))
    # The same configuration twice: the ratio is 1 with little spread, but a target of 0 is
    # never reached, so the cap holds; any interval is within an infinite target as soon as allowed.
    assert len(ctx.rounds([same, same], 2, 4, target=0.0)["rounds"]) == 4
    assert len(ctx.rounds([same, same], 2, 4, target=math.inf)["rounds"]) == 2


def test_a_candidate_is_measured_with_nothing_left_by_another():
    """A winner with num_threads=1 measured in one worker beside the baseline: the baseline
    still runs with the default thread count, as it does alone."""
    ctx = _context(StateProbe())
    StateProbe.log.clear()
    default_threads = torch.get_num_threads()
    baseline = dict(Config({"batch_size": 8}))
    one_thread = dict(Config({"batch_size": 16, "num_threads": 1}))
    ctx.run_trial(one_thread)
    ctx.rounds([baseline, one_thread], 2, 2)
    alone = [e for e in StateProbe.log if e["batch"] == 8]
    assert alone and {e["threads"] for e in alone} == {default_threads}
    assert {e["threads"] for e in StateProbe.log if e["batch"] == 16} == {1}
    assert not any(e["autocast"] for e in StateProbe.log)


def test_global_state_changed_by_a_build_is_restored_before_the_next():
    import torch._inductor.config as inductor_config

    saved = snapshot()
    try:
        # What a library (torchao's quantize_, say) or a knob could leave behind.
        torch.set_num_threads(1)
        inductor_config.freezing = not inductor_config.freezing
        torch.backends.mha.set_fastpath_enabled(not torch.backends.mha.get_fastpath_enabled())
        torch.set_float32_matmul_precision("medium")
        assert saved.differences(snapshot())
        restore(saved)
        assert saved.differences(snapshot()) == []
    finally:
        restore(saved)


def test_tf32_off_keeps_pytorchs_defaults():
    from autotune._pristine import precision, tf32_on
    from autotune.trial.build import settings_active

    stock = precision()
    with settings_active({"tf32": False}):
        # The baseline keeps stock PyTorch: cuDNN may use TF32, as PyTorch allows by default.
        assert precision() == stock and not tf32_on()
    with settings_active({"tf32": True}):
        assert tf32_on()
    assert precision() == stock and not tf32_on()


def test_precision_set_through_the_new_api_is_read_and_restored_without_mixing():
    """torch >= 2.9 raises when the legacy TF32 flags are read after the per-backend
    ``fp32_precision`` was set (newer inductor and transformers set it)."""
    from autotune._pristine import precision, restore, snapshot, tf32_on
    from autotune.trial.build import settings_active

    matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if matmul is None:
        pytest.skip("this torch has no fp32_precision API")
    saved = snapshot()
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"  # as a library does it
        state = snapshot()  # reads nothing legacy: this raised before
        with settings_active({"tf32": True}):
            assert tf32_on()
        assert not tf32_on() and precision() == state.precision
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        restore(state)
        assert precision() == state.precision
    finally:
        restore(saved)
    assert precision() == saved.precision


class _TwoProcesses(InProcessRunner):
    """An in-process runner that says it starts fresh workers (a restart keeps its one context),
    logging its restarts and the rounds asked of it (their configurations' batch sizes), with
    their replies."""

    restarts = True

    def __init__(self):
        super().__init__(WorkerSpec(model=MLP(), dataset=classification_data(128), metric=None, device="cpu",
                                    baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
                                    measure=FAST))  # fmt: skip
        self.calls, self.replies = [], []

    def restart(self, spare=False) -> bool:
        self.calls.append("restart")
        return True

    def call(self, name, *args, n_trials=1):
        reply = super().call(name, *args, n_trials=n_trials)
        if name == "rounds":
            self.calls.append((name, [c["batch_size"] for c in args[0]]))
            self.replies.append(reply["rounds"])
        return reply


def _record(number: int, config: dict, sps: float) -> dict:
    return {"number": number, "config": config, "key": Config(config).key(), "samples_per_s": sps}


@pytest.mark.slow  # CI time: test_confirmation_rounds_run_in_two_fresh_worker_processes_and_the_interval_holds_both checks fresh rounds
def test_the_claim_comes_from_fresh_rounds_of_the_pick_not_the_selection():
    ctx = _context(MLP())
    runner = InProcessRunner.__new__(InProcessRunner)
    runner._ctx, runner.info = ctx, ctx.info
    calls = []
    original = ctx.rounds

    def spy(configs, *args):
        calls.append([c["batch_size"] for c in configs])
        return original(configs, *args)

    ctx.rounds = spy
    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    finalists = [
        _record(1, dict(Config({"batch_size": 16})), 300.0),
        _record(2, dict(Config({"batch_size": 32})), 200.0),
    ]
    _, confirmed, table = claim_speedup(runner, baseline, finalists, 2, speed_only=True, settings=FAST, diagnose=True)
    # Selection measured the finalists alone; the confirmation measured only the baseline and the pick.
    assert calls[0] == [16, 32] and len(calls) == 2 and len(calls[1]) == 2 and calls[1][0] == 8
    picked = next(row for row in table if row.get("picked"))
    assert all(row["against"] == 1 for row in table)  # each finalist's ratio is to the fastest trial's
    assert calls[1][1] == next(f for f in finalists if f["number"] == picked["trial"])["config"]["batch_size"]
    claim = confirmed["claim"]
    assert claim["n_rounds"] >= 2 and claim["low"] <= claim["speedup"] <= (claim["high"] or math.inf)
    # One number: the figures shown are those whose ratio is the claim.
    assert confirmed["best"]["samples_per_s"] / confirmed["baseline"]["samples_per_s"] == pytest.approx(
        claim["speedup"]
    )
    assert "loader_samples_per_s" in confirmed["baseline"] and "model_samples_per_s" in confirmed["best"]


def test_no_measurable_speedup_keeps_the_baseline():
    baseline = {"key": "a", "samples_per_s": 100.0, "config": {}}
    pick = {"key": "b", "samples_per_s": 150.0, "config": {}, "number": 3}
    confirmed = {"claim": judge([1.1, 0.9, 1.05, 0.95, 1.0], 0.0, 0.1), "kept_baseline": 3}
    fields = _claim_fields(baseline, baseline, confirmed, False)
    assert fields["verdict"] == "none" and fields["speedup"] == 1.0 and fields["rejected_trial"] == 3
    unconfirmed = _claim_fields(baseline, pick, None, True)
    assert unconfirmed["verdict"] == "unconfirmed" and "interrupted" in unconfirmed["sentence"]


def test_busy_processes_leave_no_claim_and_the_run_says_so_quickly(tmp_path):
    """The CI version of the test below: the same run beside processes keeping half the cores
    busy, in this process (no worker to start), two trials, no profile; the same promises."""
    import os

    import autotune
    from tests.models import CpuHog

    hogs = [CpuHog(60) for _ in range(max(1, (os.cpu_count() or 2) // 2))]
    try:
        result = autotune.optimize(
            MLP(),
            classification_data(),
            space={"base": None, "batch_size": [8, 64]},
            baseline_batch_size=8,
            measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
            n_trials=2,
            n_verify_pairs=1,
            n_finalists=1,
            out_dir=tmp_path,
            device="cpu",
            isolation="inprocess",
            export=(),
            profile=False,
            progress=False,
        )
    finally:
        for hog in hogs:
            hog.stop()
    assert result.verdict in ("noisy", "none"), result.claim
    saved = json.loads((tmp_path / "best_config.json").read_text())
    assert result.best_config == saved["baseline_config"] and result.speedup == 1.0
    # No speedup is claimed: none measured in the rounds, or (the trials' figures disturbed as much)
    # none measured among the trials, where the baseline is best.
    assert not result.claimed or saved["speedup"]["method"] == "baseline is best", saved["speedup"]
    noisy = [t for t in result.study.trials if t.user_attrs.get("noisy")]
    assert noisy and all("other processes used" in t.user_attrs["noise"] for t in noisy)
    assert "The machine was busy" in (tmp_path / "report.md").read_text()


@pytest.mark.slow  # CI runs the in-process version above
def test_a_run_beside_busy_processes_claims_no_speedup_and_says_so(tmp_path):
    """With other processes keeping half the machine busy, the run must not present a clean
    speedup: the rounds see the interference, and the summary and report say so."""
    import os

    import autotune
    from tests.models import CpuHog

    hogs = [CpuHog(120) for _ in range(max(1, (os.cpu_count() or 2) // 2))]
    try:
        result = autotune.optimize(
            MLP(),
            classification_data(),
            space={"base": None, "batch_size": [8, 32, 64]},
            baseline_batch_size=8,
            measure={"n_windows": 2, "window_s": 0.1, "warmup_batches": 1, "n_remeasure": 1},
            n_trials=3,
            n_verify_pairs=2,
            out_dir=tmp_path,
            device="cpu",
            export=(),
        )
    finally:
        for hog in hogs:
            hog.stop()
    assert result.verdict in ("noisy", "none"), result.claim
    # Nothing confirmed: the model as given stands, whatever trial looked fastest under the load.
    saved = json.loads((tmp_path / "best_config.json").read_text())
    assert result.best_config == saved["baseline_config"] and result.speedup == 1.0
    noisy = [t for t in result.study.trials if t.user_attrs.get("noisy")]
    assert noisy and all("other processes used" in t.user_attrs["noise"] for t in noisy)
    assert "The machine was busy" in (tmp_path / "report.md").read_text()


class _SleepyMLP(MLP):
    """An MLP that sleeps 2 ms per call: one sample per batch is then many times slower than 32,
    however busy the machine (sleeping only lengthens, for both)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.002)
        return super().forward(x)


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_a_single_finalist_measurably_slower_is_not_shipped(tmp_path):
    """The only candidate (batch 1 of a model with a fixed cost per call) is about 30 times
    slower than the baseline (batch 32): its confirmation must say ``slower`` and keep the
    baseline, not claim a 0.03x "speedup"."""
    import autotune

    result = autotune.optimize(
        _SleepyMLP(),
        classification_data(128),
        space={"base": None, "batch_size": [1]},
        baseline_batch_size=32,
        # Timed fully: multi-fidelity would stop a candidate this far below the baseline.
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "stop_share": 0},
        n_trials=2,
        n_verify_pairs=3,
        out_dir=tmp_path,
        device="cpu",
        isolation="inprocess",
        export=(),
    )
    saved = json.loads((tmp_path / "best_config.json").read_text())
    assert result.verdict == "slower", result.claim
    assert result.best_config["batch_size"] == 32 and result.best_config == saved["baseline_config"]
    assert result.speedup == 1.0 and not result.claimed
    assert saved["speedup"]["rejected"]["high"] < 1.0 and saved["speedup"]["method"] == "pick slower, baseline kept"
    assert "slower" in (tmp_path / "report.md").read_text()


def test_confirmation_rounds_run_in_two_fresh_worker_processes_and_the_interval_holds_both(tmp_path):
    """A process's threads can run a small model at a speed that lasts its whole life and differs
    from the next process's: the claim must not rest on one process. Its rounds are split over two
    worker processes, each drawing batches no other round read, and its interval contains both
    processes' ratios."""
    from autotune.run.rounds import confirm
    from autotune.trial.runner import SubprocessRunner, pickle_spec

    spec = WorkerSpec(model=_SleepyMLP(), dataset=classification_data(128), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 1})), val_indices=list(range(16)), measure=FAST)  # fmt: skip
    runner = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "worker.log")
    try:
        baseline = _record(0, dict(Config({"batch_size": 1})), 100.0)
        pick = _record(1, dict(Config({"batch_size": 32})), 3000.0)
        trials_pid = runner.call("rounds", [baseline["config"]], 1, 1)["pid"]  # the worker that ran the trials
        confirmed = confirm(runner, baseline, pick, FAST, n_min=4, n_max=4)
        first_process_pid = confirmed["worker_pids"][0]
        again = runner.call("rounds", [baseline["config"]], 1, 1)
    finally:
        runner.close()
    claim = confirmed["claim"]
    pids = confirmed["worker_pids"]
    assert len(pids) == 2 and pids[0] != pids[1] and first_process_pid != again["pid"], pids
    assert trials_pid not in pids  # both fresh: not the worker whose trials left their state behind
    assert len(claim["processes"]) == 2 and claim["n_rounds"] == 4
    assert claim["low"] <= min(claim["processes"]) <= max(claim["processes"]) <= claim["high"]
    # 30x apart, the pick is a speedup; "noisy" only where another process used the CPU during
    # the rounds (a loaded host), which the claim must then say instead.
    assert claim["verdict"] in ("speedup", "noisy") and "in 2 worker processes" in claim["sentence"]
    assert claim["verdict"] == "speedup" or claim["others_cpu"] > FAST.max_others_cpu
    # Confirmation draws batches of its own (after CONFIRM_DRAWS), the second process after the
    # first's two rounds: neither re-reads a batch draw that the trials worker's round read.
    assert again["drawn"] == CONFIRM_DRAWS + 5
    # Each round's own figures stay with the claim, by process: the claim is their ratios' mean.
    rows = claim["rounds"]
    assert [r["process"] for r in rows] == [0, 0, 1, 1]
    ratios = [r["pick_samples_per_s"] / r["baseline_samples_per_s"] for r in rows]
    assert abs(geomean(ratios) / claim["speedup"] - 1) < 0.01


def test_one_process_ratio_at_no_speedup_makes_the_claim_none():
    """Rounds that show a clear speedup in one process and none in the other: no speedup."""
    rounds = [1.5, 1.52, 1.49, 0.99, 0.98, 1.0]
    claim = judge(rounds, 0.0, 0.1, processes=[geomean(rounds[:3]), geomean(rounds[3:])])
    assert claim["verdict"] in ("none", "noisy") and claim["low"] <= 0.99


def test_a_confirmation_cut_short_by_its_time_budget_says_how_many_rounds_and_processes_it_had(tmp_path):
    """Two fresh worker processes are planned; a budget of a fraction of a second leaves the
    second no time after the first's least rounds: the claim says it rests on those rounds in
    one process, and why."""
    from autotune.run.rounds import confirm
    from autotune.trial.runner import SubprocessRunner, pickle_spec

    spec = WorkerSpec(model=MLP(), dataset=classification_data(128), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=FAST)  # fmt: skip
    runner = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "worker.log")
    try:
        baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
        pick = _record(1, dict(Config({"batch_size": 32})), 300.0)
        confirmed = confirm(runner, baseline, pick, FAST, n_min=4, n_max=12, max_s=0.2, diagnose=False)
    finally:
        runner.close()
    claim = confirmed["claim"]
    assert len(confirmed["worker_pids"]) == 1 and claim["n_processes"] == 1 and claim["n_rounds"] == 2
    assert f"over {claim['n_rounds']} rounds in 1 process" in claim["sentence"], claim["sentence"]
    assert "1 process of the 2 planned" in claim["sentence"] and "too little for another" in claim["sentence"]
    assert claim["shortfall"] in claim["sentence"]


def test_rounds_run_in_this_process_say_so_in_the_claim():
    ctx = _context(MLP())
    runner = InProcessRunner.__new__(InProcessRunner)
    runner._ctx, runner.info = ctx, ctx.info
    from autotune.run.rounds import confirm

    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    pick = _record(1, dict(Config({"batch_size": 32})), 300.0)
    claim = confirm(runner, baseline, pick, FAST, n_min=2, n_max=2, diagnose=False)["claim"]
    assert "over 2 rounds in 1 process" in claim["sentence"]
    assert "1 process of the 2 planned (isolation='inprocess' starts no worker process)" in claim["sentence"]


def test_a_full_confirmation_adds_nothing_to_its_sentence():
    claim = judge([1.5, 1.52, 1.49, 1.51], 0.0, 0.1, processes=[1.51, 1.5])
    assert claim["shortfall"] is None and "planned" not in claim["sentence"]
    short = judge([1.5, 1.52], 0.0, 0.1, shortfall="less than planned: 1 process of the 2 planned (budget)")
    assert short["sentence"].endswith("; less than planned: 1 process of the 2 planned (budget)")
    assert "over 2 rounds in 1 process)" in short["sentence"]


class _SlowFirstCall(MLP):
    """An MLP each copy of which takes 4 s on its first call, as a compile in a build does."""

    warm = weakref.WeakSet()  # not ids: a freed copy's id comes back for the next one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self not in self.warm:
            import time

            time.sleep(4.0)
            self.warm.add(self)
        return super().forward(x)


@pytest.mark.slow  # CI time (27 s): the other confirmation tests run its rounds; this one prices builds apart
def test_without_a_time_limit_the_confirmation_counts_its_rounds_not_its_builds():
    """Without a run timeout the confirmation had 90 s plus twice the builds the trials measured
    (a cold compile): a compiled pick's claim took 141-218 s. The builds are now paid as they
    come (a compile from the run's cache) and the limit counts the rounds alone."""
    ctx = _context(_SlowFirstCall())
    configs = [dict(Config({"batch_size": 8})), dict(Config({"batch_size": 32}))]
    # A limit the builds (8 s) overrun many times, and that rounds of a tiny MLP (0.1-0.4 s on
    # a quiet machine) meet well within, even on a loaded one.
    counted = ctx.rounds(configs, 1, 3, max_s=3.0)
    assert len(counted["rounds"]) == 1 and counted["built_s"] >= 8.0  # the builds ate the limit
    ctx = _context(_SlowFirstCall())
    free = ctx.rounds(configs, 1, 3, max_s=3.0, builds_free=True)
    assert len(free["rounds"]) > 1 and free["built_s"] >= 8.0
    assert not any("warmup_s" in c for r in free["rounds"] for c in r)


def test_the_loader_and_the_model_alone_are_timed_in_the_first_round_only():
    """The diagnosis explains the claim: timed apart in every round, it made a confirmation half
    as long again; from one round per process, the figures still come from the claim's rounds."""
    from autotune.run.rounds import _figures

    ctx = _context(MLP())
    configs = [dict(Config({"batch_size": 8})), dict(Config({"batch_size": 32}))]
    rounds = ctx.rounds(configs, 3, 3, diagnose=True)["rounds"]
    assert len(rounds) == 3
    assert all("loader_samples_per_s" in c and "model_samples_per_s" in c for c in rounds[0])
    assert not any("loader_samples_per_s" in c for r in rounds[1:] for c in r)
    figures = _figures(rounds, 1)
    assert figures["loader_samples_per_s"] == rounds[0][1]["loader_samples_per_s"]
    assert figures["model_samples_per_s"] == rounds[0][1]["model_samples_per_s"]
    assert "loader_samples_per_s" not in ctx.rounds(configs, 2, 2)["rounds"][0][0]  # not asked: not timed


def test_a_confirmation_times_the_loader_and_the_model_alone_in_its_first_process_only():
    """Timed apart in each process's first round, the halves took 10 s a configuration of a
    second process's rounds of real MiniLM: one process's explain the claim as well."""
    from autotune.run.rounds import confirm

    runner = _TwoProcesses()
    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    pick = _record(1, dict(Config({"batch_size": 32})), 300.0)
    out = confirm(runner, baseline, pick, FAST, n_min=4, n_max=4, diagnose=True)
    first, second = runner.replies
    assert all("loader_samples_per_s" in c and "model_samples_per_s" in c for c in first[0])
    assert not any("loader_samples_per_s" in c for r in [*first[1:], *second] for c in r)
    assert out["claim"]["n_processes"] == 2
    assert out["best"]["loader_samples_per_s"] == first[0][1]["loader_samples_per_s"]


def test_the_least_rounds_of_a_confirmation_are_split_over_its_processes_not_rounded_up_in_each():
    """Five rounds asked for over two processes were three in each: six rounds, one of them a
    whole round of the slow baseline more than asked for."""
    from autotune.run.rounds import confirm

    runner = _TwoProcesses()
    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    pick = _record(1, dict(Config({"batch_size": 32})), 300.0)
    # A cap below the least: each process runs exactly what it owes, whatever the rounds' spread
    # (rounded up in each, it was 3 and 3).
    claim = confirm(runner, baseline, pick, FAST, n_min=5, n_max=4, diagnose=False)["claim"]
    assert claim["n_processes"] == 2 and claim["n_rounds"] == 5


def test_without_a_time_limit_the_rounds_keep_the_finish_within_a_quarter_of_the_run():
    """45 s of selection and 90 s of confirmation rounds, whatever the run, took 160 s of a
    260-s finish after a 173-s search of real MiniLM; rounds of a quarter of the run before them
    besides the starts, builds and export still made the finish 35% of a 16-trial run. The
    rounds have what keeps the whole finish within a quarter of the run, split as before, never
    more than before and never under the floor."""
    from autotune.run.rounds import CONFIRM_S, SELECT_S

    class Spy(InProcessRunner):
        limits: list = []

        def call(self, name, *args, n_trials=1):
            if name == "rounds":
                self.limits.append((len(args[0]), args[4], args[8], args[9]))
            return super().call(name, *args, n_trials=n_trials)

    runner = Spy(WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                            baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=FAST))  # fmt: skip
    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    finalists = [
        _record(1, dict(Config({"batch_size": 32})), 300.0),
        _record(2, dict(Config({"batch_size": 16})), 290.0),
    ]
    # 90 s before the finish: a quarter of the run is 30 s of finish; 12 s of it go elsewhere.
    cases = ((90.0, 0.0, (10.0, 20.0)), (90.0, 12.0, (6.0, 12.0)), (90.0, 60.0, (0.0, 20 / 3)),
             (None, 0.0, (SELECT_S, CONFIRM_S)))  # fmt: skip
    for spent, other, (select_max, confirm_max) in cases:
        Spy.limits.clear()
        _, confirmed, _ = claim_speedup(runner, baseline, finalists, 2, False, FAST, diagnose=False, spent_s=spent,
                                        other_s=other)  # fmt: skip
        (n_select, select_s, select_free, select_windows), (n_confirm, confirm_s, confirm_free, windows) = Spy.limits
        assert n_select == 2 and n_confirm == 2  # the finalists alone, then the baseline and the pick
        assert select_windows == 1 and windows == 0  # choosing on one window each, claiming on the worker's two
        assert select_s == pytest.approx(select_max) and select_free and confirm_free  # rounds' seconds, not builds'
        assert confirm_max - 5.0 <= confirm_s <= confirm_max  # less the selection's seconds at most
        assert confirmed["claim"]["n_rounds"] >= 2


def test_without_a_time_limit_the_least_rounds_run_in_both_processes_however_short_their_time():
    """A run without a deadline gives its rounds a share of its time; short as that may be, the
    least confirmation (its rounds in two fresh processes) is run: at 20 s, a claim of real
    MiniLM came from 3 rounds in 1 process."""
    from autotune.run.rounds import confirm

    runner = _TwoProcesses()
    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    pick = _record(1, dict(Config({"batch_size": 32})), 300.0)
    claim = confirm(runner, baseline, pick, FAST, n_min=5, n_max=15, max_s=0.01, builds_free=True)["claim"]
    assert claim["n_processes"] == 2 and claim["n_rounds"] == 5
    # With a deadline, time that runs out still ends the confirmation after its first process.
    claim = confirm(runner, baseline, pick, FAST, n_min=5, n_max=15, max_s=0.01)["claim"]
    assert claim["n_processes"] == 1 and "1 process of the 2 planned" in claim["sentence"]


def test_a_workers_later_rounds_time_the_builds_its_last_rounds_made_unless_a_compile_came_between():
    """A confirmation in the selection's worker rebuilt the baseline and the pick, and a
    compiled MiniLM pick's build and first warm-up took 8-9 s again. Its builds are kept for the
    next rounds and the profile; a new compiled build between drops them (its dynamo reset
    drops their compiled code), and so does a trial."""
    ctx = _context(MLP())
    base, pick = dict(Config({"batch_size": 8})), dict(Config({"batch_size": 32, "compile_mode": "default"}))
    first = ctx.prepare([base, pick])
    again = ctx.prepare([base, pick])
    assert again[0] is first[0] and again[1] is first[1]  # builds are lazy: nothing was compiled here
    other = dict(Config({"batch_size": 16, "compile_mode": "default"}))
    rebuilt = ctx.prepare([base, pick, other])
    assert rebuilt[0] is first[0] and rebuilt[1] is not first[1]  # the eager baseline's build stands
    kept = ctx.prepare([base, dict(Config({"batch_size": 16}))])
    assert kept[0] is first[0]
    ctx.run_trial(dict(Config({"batch_size": 16})))
    assert ctx.prepare([base])[0] is not first[0]


def test_a_builds_later_rounds_run_warm_without_a_collection(monkeypatch):
    """The plain baseline of real MiniLM warmed up three batches and collected the heap before
    every round of every configuration: a second of each round. A build's first round warms up
    as a trial does; its later rounds in the same worker run one batch first (where the loader
    starts no workers) and collect nothing; the builds' first warm-up stays what is counted as
    building."""
    import autotune.trial.inference as inference

    seen, clocks = [], []
    real = inference.measure

    def spy(state, dataset, settings, **kw):
        seen.append((state.batch_size, settings.warmup_batches, kw.get("mem_mark") is None))
        clocks.append(kw.get("clock_windows"))  # a round's windows but its last end on the clock
        return real(state, dataset, settings, **kw)

    monkeypatch.setattr(inference, "measure", spy)
    ctx = _context(MLP(), measure=MeasureSettings(n_windows=2, window_s=0.01, warmup_batches=3))
    base, pick = dict(Config({"batch_size": 8})), dict(Config({"batch_size": 32}))
    reply = ctx.rounds([base, pick], 3, 3)
    assert len(reply["rounds"]) == 3
    assert seen[:2] == [(8, 3, True), (32, 3, True)]  # first rounds: a trial's warm-up, memory marked
    assert set(seen[2:]) == {(8, 1, False), (32, 1, False)}
    seen.clear()
    ctx.rounds([base, pick], 2, 2)  # the next call in this worker (the confirmation) times them warm
    assert set(seen) == {(8, 1, False), (32, 1, False)}
    workers = dict(Config({"batch_size": 8, "num_workers": 1}))
    seen.clear()
    ctx.rounds([workers], 2, 2)  # a loader with workers starts them again each round: its warm-up stands
    assert [w for _, w, _ in seen] == [3, 3]
    assert clocks and all(clocks), clocks


def test_a_rounds_diagnosis_takes_the_model_half_from_its_warm_rounds_where_batches_load_in_process(monkeypatch):
    """Where the batches load in the worker's own process on the CPU, a confirmation's diagnosis
    takes the model alone from the rounds after the first (each batch's call timed apart from its
    loading), not from another pass over the epoch (the plain Hugging Face baseline's 2 s of a
    3.8-s diagnosis); the loader is still timed alone. With loader workers, which share the
    cores, the model is timed alone right after the first round, warm: its warm-up batches, not
    every batch again."""
    import autotune.trial.diagnose as diagnose
    import autotune.trial.measure as measure_mod

    every, windows = [], []
    real, real_measure = diagnose.model_samples_per_s, measure_mod.measure

    def spy(*a, **kw):
        every.append(kw.get("every", True))
        return real(*a, **kw)

    def seen(*a, **kw):
        m = real_measure(*a, **kw)
        windows.append(m)
        return m

    monkeypatch.setattr(diagnose, "model_samples_per_s", spy)
    monkeypatch.setattr("autotune.trial.inference.measure", seen)
    ctx = _context(MLP(), measure=MeasureSettings(n_windows=2, window_s=0.01, warmup_batches=1))
    configs = [dict(Config({"batch_size": 8})), dict(Config({"batch_size": 32}))]
    first, second, third = ctx.rounds(configs, 3, 3, diagnose=True)["rounds"]
    assert every == []
    # Rounds alternate (A, B / B, A): the warm rounds' measurements of each configuration.
    later = {0: [windows[3], windows[4]], 1: [windows[2], windows[5]]}
    # The model's seconds are its calls inside the windows: never more than the windows' time.
    assert all(0 < m["model_s"] <= m["timed_s"] for m in windows), windows
    for i, c in enumerate(first):
        expected = sum(m["timed_samples"] for m in later[i]) / sum(m["model_s"] for m in later[i])
        assert c["model_samples_per_s"] == pytest.approx(expected)
        # The model's seconds are a part of the rounds': alone, it is at least as fast.
        assert c["loader_samples_per_s"] > 0 and c["model_samples_per_s"] >= min(second[i]["samples_per_s"],
                                                                                third[i]["samples_per_s"])  # fmt: skip
    assert all("model_samples_per_s" not in c for c in second + third)  # the first round's alone
    assert all("model_s" not in c and "timed_samples" not in c for c in first + second + third)
    workers = dict(Config({"batch_size": 8, "num_workers": 1}))
    reply = ctx.rounds([workers], 1, 1, diagnose=True)
    assert every == [False] and reply["rounds"][0][0]["model_samples_per_s"] > 0


def test_a_round_times_the_windows_asked_for_each_configuration(monkeypatch):
    """A round times the windows asked for, else the worker's own number for a round: one (a
    round is one ratio of the claim, and the rounds' spread its noise), whatever a trial times."""
    import autotune.trial.inference as inference

    seen = []
    real = inference.measure

    def spy(state, dataset, settings, **kw):
        seen.append(settings.n_windows)
        return real(state, dataset, settings, **kw)

    monkeypatch.setattr(inference, "measure", spy)
    ctx = _context(MLP(), measure=MeasureSettings(n_windows=5, window_s=0.01, warmup_batches=1))
    configs = [dict(Config({"batch_size": 8})), dict(Config({"batch_size": 32}))]
    ctx.rounds(configs, 1, 1, windows=3)
    assert seen == [3, 3]
    seen.clear()
    ctx.rounds(configs, 1, 1)
    assert seen == [inference.ROUND_WINDOWS] * 2 and inference.ROUND_WINDOWS == 1


def test_without_a_time_limit_the_selection_runs_in_a_fresh_worker_that_then_confirms():
    """The selection's fresh worker is the confirmation's first process: a fresh worker's start
    and both builds are paid once, not twice (17 s of each process of real MiniLM)."""
    runner = _TwoProcesses()
    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    finalists = [
        _record(1, dict(Config({"batch_size": 32})), 300.0),
        _record(2, dict(Config({"batch_size": 16})), 290.0),
    ]
    best, confirmed, _ = claim_speedup(runner, baseline, finalists, 2, False, FAST, diagnose=False, spent_s=60.0)
    both = ("rounds", [8, best["config"]["batch_size"]])
    assert runner.calls == ["restart", ("rounds", [32, 16]), both, "restart", both]
    assert confirmed["claim"]["n_processes"] == 2
    # Under a deadline the selection runs in the search's worker, as before.
    runner.calls.clear()
    claim_speedup(runner, baseline, finalists, 2, False, FAST, diagnose=False, budget_s=600.0, need_s=1.0)
    assert runner.calls[:2] == [("rounds", [32, 16]), "restart"]


def test_a_finish_already_at_its_share_selects_on_two_rounds_not_on_seconds_of_them():
    """Without a time limit the selection has seconds of rounds from what the finish's share
    leaves; where the rest of the finish takes that share already, it runs its least two rounds
    (a real MiniLM selection's 3.3 s at the floor were four rounds where two decided it), and a
    finish with room runs as many as its seconds hold."""
    runner = _TwoProcesses()
    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    finalists = [
        _record(1, dict(Config({"batch_size": 32})), 300.0),
        _record(2, dict(Config({"batch_size": 16})), 290.0),
    ]
    claim_speedup(runner, baseline, finalists, 5, False, FAST, diagnose=False, spent_s=146.0, other_s=42.0)
    assert len(runner.replies[0]) == 2
    runner.calls.clear(), runner.replies.clear()
    claim_speedup(runner, baseline, finalists, 5, False, FAST, diagnose=False, spent_s=1000.0, other_s=0.0)
    assert len(runner.replies[0]) == 5  # rounds of these tiny models: as many as asked fit


def test_a_budget_weighs_a_fresh_workers_start_before_splitting_its_least_confirmation_in_two():
    """The least confirmation is priced in the search's own worker (as the search's reserve
    promised it); whether it fits twice, in two fresh workers, counts their starts too."""
    runner = _TwoProcesses()
    runner.start_s = 8.0
    baseline = _record(0, dict(Config({"batch_size": 8})), 100.0)
    pick = _record(1, dict(Config({"batch_size": 32})), 300.0)
    # 30 s hold 10 s of confirmation twice, but not with an 8-s start each: one process, no start.
    claim_speedup(runner, baseline, [pick], 3, False, FAST, diagnose=False, budget_s=30.0, need_s=10.0)
    assert runner.calls == [("rounds", [8, 32])]
    runner.calls.clear()
    claim_speedup(runner, baseline, [pick], 3, False, FAST, diagnose=False, budget_s=40.0, need_s=10.0)
    assert runner.calls[0] == "restart" and runner.calls.count("restart") == 2


def test_a_fast_models_confirmation_rounds_are_short_and_many(monkeypatch):
    """The quickstart's MLP ran an epoch in 22 ms, yet each round timed 0.4-s windows: 5 rounds in
    10 s could not tell a 1.75x pick from 1.0. Windows sized to the baseline's batches give a
    fast model short rounds, and more of them in the same time; a slow model keeps its windows."""
    import autotune.trial.inference as inference
    from autotune.run.options import DEFAULT_MEASURE
    from autotune.run.rounds import round_window
    from autotune.trial.measure import MeasureSettings

    defaults = MeasureSettings(**DEFAULT_MEASURE)
    fast = {"samples_per_s": 200_000.0, "config": {"batch_size": 32}}
    window, more = round_window(fast, defaults)
    assert window < defaults.window_s and more == int(defaults.window_s / window) > 1
    assert round_window({"samples_per_s": 90.0, "config": {"batch_size": 32}}, defaults) == (defaults.window_s, 1)
    settings = _context(MLP()).spec.measure
    window = settings.window_s / 3  # this test's timing settings are short already
    seen = []
    real = inference.measure
    monkeypatch.setattr(
        inference, "measure", lambda state, data, s, **kw: seen.append(s.window_s) or real(state, data, s, **kw)
    )
    ctx = _context(MLP())
    same = dict(Config({"batch_size": 8}))
    ctx.rounds([same, same], 2, 2, window_s=window)
    assert seen == [window] * 4  # every window of every round: the short one
    ctx.rounds([same, same], 2, 2)
    assert seen[4:] == [settings.window_s] * 4
