"""A run's deadline arithmetic: trials and the finish priced from what the study measured."""

import pytest

from autotune.search.cost import EXPORT_TRIALS, FIRST_BUILD_S, finish_s, trial_cost_s

COMPILE_S = FIRST_BUILD_S["compile"][0]  # a first compile's prior for a model of no parameters

BASE = {"config": {"compile_mode": "none", "runtime": "torch", "batch_size": 8}, "ran": True, "wall_s": 3.0,
        "timed_s": 2.0, "compile_s": 0.2}  # fmt: skip


def test_a_first_compile_is_priced_by_a_prior_and_later_ones_by_what_compiles_cost():
    first = trial_cost_s({**BASE["config"], "compile_mode": "default"}, [BASE], BASE)
    assert first == pytest.approx(3.0 + COMPILE_S)  # the prior, before any compile was timed
    slow = {"config": {**BASE["config"], "compile_mode": "default"}, "ran": True, "wall_s": 70.0, "compile_s": 60.0}
    # Another compile mode costs what the slowest compile cost so far, on the baseline's time.
    assert trial_cost_s({**BASE["config"], "compile_mode": "max-autotune"}, [BASE, slow], BASE) == 63.0
    # The same kind of build at another batch: what that build took.
    assert trial_cost_s({**BASE["config"], "compile_mode": "default", "batch_size": 64}, [BASE, slow], BASE) == 70.0
    # A cheap change costs a baseline trial; before the baseline nothing is known.
    assert trial_cost_s({**BASE["config"], "batch_size": 64}, [BASE, slow], BASE) == 3.0
    assert trial_cost_s(BASE["config"], [], None) == 0.0


def test_a_first_int8_build_under_a_runtime_is_priced_apart_from_its_float_builds():
    """OpenVINO's float builds convert (2 s); its int8 also calibrates with NNCF and ranks layers
    (13-20 s of real MiniLM). Priced as the float trials (8 s), a 3-minute budget started one
    with 18 s left and it was killed at the deadline. A first int8 build costs a cheap trial, the
    conversion and a calibration (each its prior until a trial made one), or, once the runtime's
    float builds ran, the slowest of them and a calibration, whatever a compile took. Later ones
    cost what the int8 trials took."""
    base = {"config": {**BASE["config"], "ov_precision": "fp32"}, "ran": True, "baseline": True, "wall_s": 10.0}
    ov = {**base["config"], "runtime": "openvino"}
    floats = [{"config": {**ov, "ov_precision": p}, "ran": True, "wall_s": 8.0, "build_s": 2.3, "compile_s": 0.1}
              for p in ("fp32", "bf16")]  # fmt: skip
    int8 = {**ov, "ov_precision": "int8_static", "int8_fallback": "auto"}
    calibrate = FIRST_BUILD_S["calibrate"][0]
    assert trial_cost_s({**ov, "ov_precision": "bf16", "batch_size": 64}, [base, *floats], base) == 8.0
    first = 10.0 + FIRST_BUILD_S["openvino"][0] + calibrate  # no OpenVINO build yet: the priors
    assert trial_cost_s(int8, [base], base) == pytest.approx(first)
    compiled = {"config": {**base["config"], "compile_mode": "default"}, "ran": True, "wall_s": 28.0, "compile_s": 19.4}
    assert trial_cost_s(int8, [base, compiled], base) == pytest.approx(first)  # a compile is no part of it
    # The runtime's float builds ran: theirs, and a calibration, whatever a compile took.
    assert trial_cost_s(int8, [base, *floats], base) == pytest.approx(8.0 + calibrate)
    assert trial_cost_s(int8, [base, *floats, compiled], base) == pytest.approx(8.0 + calibrate)
    # Another int8 of the runtime, which calibrated as well, is not a float build to add one to;
    # what its calibration took prices the next.
    other = {
        "config": {**int8, "int8_fallback": 0},
        "ran": True,
        "wall_s": 20.0,
        "compile_s": 12.0,
        "int8_made_s": 11.0,
    }
    assert trial_cost_s(int8, [base, *floats, other], base) == pytest.approx(8.0 + 11.0)
    done = {"config": int8, "ran": True, "wall_s": 21.0, "build_s": 13.3}
    assert trial_cost_s({**int8, "batch_size": 64}, [base, *floats, done], base) == 21.0


def test_a_first_build_of_real_minilm_is_priced_near_what_it_took():
    """all-MiniLM-L6-v2 (22.7M parameters) on 2 cores: cheap trials 5-11 s, the first OpenVINO
    trial 8-14 s (conversion 2.1-5.0 s), the first NNCF int8 26-31 s (its calibration 17-22 s),
    the first compile 60-74 s (52-57 s of it compiling). Priced as a heavy build (the baseline's
    trial and the larger of 15 s and three of them), each was 56 s, and a budget never tried
    OpenVINO, its pipeline's winner."""
    base = {"config": {**BASE["config"], "ov_precision": "fp32"}, "ran": True, "baseline": True, "status": "ok",
            "wall_s": 35.1, "timed_s": 6.0, "compile_s": 0.6, "guard_s": 3.4, "n_measurements": 3,
            "n_params": 22_713_216}  # fmt: skip
    cheap = {"config": {**base["config"], "batch_size": 64}, "ran": True, "status": "ok", "wall_s": 8.7}
    ov = {**base["config"], "runtime": "openvino"}
    assert 8.0 <= trial_cost_s(ov, [base, cheap], base) <= 16.0
    assert 24.0 <= trial_cost_s({**ov, "ov_precision": "int8_static"}, [base, cheap], base) <= 36.0
    assert 55.0 <= trial_cost_s({**base["config"], "compile_mode": "default"}, [base, cheap], base) <= 80.0


def test_the_finish_prices_an_int8_picks_rebuilds_without_the_model_the_runs_cache_keeps():
    """A Hugging Face budget's OpenVINO int8 pick (a 12-s build, 10 of it NNCF's, in an 18-s
    trial) was priced 32 s to confirm where 31 s were left, and its export at 50 s (it took 15):
    the run ended unconfirmed with a minute of its budget unused. Its rebuilds read NNCF's model
    from the run's cache."""
    from autotune.search.cost import export_s, rebuild_s

    base = {"config": BASE["config"], "ran": True, "wall_s": 10.0, "timed_s": 5.0, "build_s": 0.1}
    made = {"config": {**BASE["config"], "runtime": "openvino"}, "ran": True, "wall_s": 18.4, "timed_s": 2.2,
            "build_s": 12.1, "compile_s": 0.1, "guard_s": 0.3, "int8_made_s": 10.0}  # fmt: skip
    assert rebuild_s(made) == pytest.approx(2.2)
    assert export_s(made) == pytest.approx(2.2 + EXPORT_TRIALS * 8.4)  # was 12.2 + EXPORT_TRIALS * 18.4
    read = {**made, "int8_cached": True}  # a trial that read it: its build is what a rebuild costs
    assert rebuild_s(read) == pytest.approx(12.2) and export_s(read) == pytest.approx(12.2 + EXPORT_TRIALS * 18.4)
    # The least confirmation (a worker's builds and two rounds) less the making, once per process.
    assert finish_s(base, read, 0.0, diagnose=False, exports=False) - finish_s(
        base, made, 0.0, diagnose=False, exports=False
    ) == pytest.approx(2 * 10.0)
    # The OpenVINO conversion a trial made and cached is priced out the same way; one read is not.
    converted = {**made, "ov_convert_s": 1.5}
    assert rebuild_s(converted) == pytest.approx(0.7)
    assert rebuild_s({**converted, "ov_converted_cached": True}) == pytest.approx(2.2)


def test_a_cheap_trial_is_priced_as_measured_once_and_by_the_cheap_trials_that_ran():
    """Real MiniLM's baseline took 34 s (its windows measured twice, the reference outputs): priced
    at that, the next cheap trial (13 s) did not fit a 3-minute budget's search."""
    base = {"config": BASE["config"], "ran": True, "baseline": True, "status": "ok", "wall_s": 34.0,
            "timed_s": 11.3, "compile_s": 1.4, "guard_s": 3.9, "n_measurements": 2}  # fmt: skip
    cheap = {**BASE["config"], "batch_size": 32}
    assert trial_cost_s(cheap, [base], base) == pytest.approx(20.3)  # one measurement of the baseline's
    ran = {"config": cheap, "ran": True, "status": "ok", "wall_s": 13.0, "n_measurements": 1}
    stopped = {"config": {**cheap, "batch_size": 128}, "ran": True, "status": "stopped", "wall_s": 5.0}
    # Once a cheap trial ran its windows, cheap trials cost what those took; an early-stopped one says less.
    assert trial_cost_s({**cheap, "batch_size": 16}, [base, stopped], base) == pytest.approx(20.3)
    assert trial_cost_s({**cheap, "batch_size": 16}, [base, stopped, ran], base) == 13.0
    # A compile costs a cheap trial plus a compile (its prior before any was timed).
    assert trial_cost_s({**cheap, "compile_mode": "default"}, [base, ran], base) == pytest.approx(13.0 + COMPILE_S)


def test_the_finish_pays_two_fresh_workers_the_builds_the_rounds_and_the_export():
    pick = {"wall_s": 70.0, "timed_s": 2.0, "compile_s": 60.0}
    with_compile = finish_s(BASE, pick, start_s=8.0)
    # Each confirmation process: a worker start and both builds; then the pick's export.
    assert with_compile >= 2 * (8.0 + 60.0) + 60.0
    assert finish_s(BASE, BASE, start_s=8.0) < with_compile / 3  # an eager pick is cheap to confirm
    assert finish_s(None, pick, 8.0) == 0.0


def test_an_export_is_priced_at_its_share_of_the_picks_trials_and_a_compiled_pick_is_exported_uncompiled():
    """A real MiniLM pick's export (ONNX and TorchScript, each with its parity check) took
    20-26 s against 10-13 s for its trial: priced at one trial, a 3-minute budget ended 10%
    past its time."""
    from autotune.search.cost import export_s

    eager = {"config": BASE["config"], "wall_s": 12.0, "build_s": 0.2, "compile_s": 0.3}
    assert export_s(eager) == pytest.approx(0.5 + EXPORT_TRIALS * 12.0)
    assert finish_s(BASE, eager, 8.0) - finish_s(BASE, eager, 8.0, exports=False) == pytest.approx(export_s(eager))
    compiled = {"config": {**BASE["config"], "compile_mode": "default"}, "wall_s": 30.0, "compile_s": 18.0}
    assert export_s(compiled) == pytest.approx(EXPORT_TRIALS * (30.0 - 18.0))  # its trials without their compile


def test_a_compile_killed_at_its_limit_raises_the_price_of_the_next():
    """A trial killed at its limit has no wall_s, only trial_s: it must not be forgotten."""
    killed = {"config": {**BASE["config"], "compile_mode": "default"}, "ran": True, "status": "timeout",
              "trial_s": 90.0}  # fmt: skip
    assert trial_cost_s({**BASE["config"], "compile_mode": "default", "batch_size": 64}, [BASE, killed], BASE) == 90.0
    late = {"config": {**BASE["config"], "compile_mode": "default"}, "ran": False, "kind": "deadline", "trial_s": 0.0}
    assert trial_cost_s({**BASE["config"], "compile_mode": "default"}, [BASE, late], BASE) == 3.0 + COMPILE_S


def test_a_trial_not_started_for_the_deadline_holds_no_result():
    """A resumed run measures it: it was never run, so it is no 'repeat' of anything."""
    from autotune.search.study import _has_result

    assert not _has_result({"status": "timeout", "kind": "deadline", "ran": False})
    assert _has_result({"status": "timeout", "kind": "deadline", "ran": True})  # stopped while running
    assert _has_result({"status": "ok", "ran": True}) and not _has_result({"status": "skipped"})


def test_a_confirmation_round_is_priced_at_the_windows_it_times():
    """A round times one window of each configuration, a trial five, and is priced at two (the
    window runs on to an epoch's end where batches differ): priced as a whole trial's
    measurement, a 90-s budget of real MiniLM (its baseline measured twice, 20.6 s) kept 45 s
    for a finish that took 10, and searched one trial."""
    from autotune.search.cost import measure_s, round_s

    base = {"wall_s": 20.6, "timed_s": 8.0, "n_windows": 5, "n_measurements": 2, "build_s": 0.1, "guard_s": 1.2}
    assert round_s(base) == pytest.approx(measure_s(base) - 8.0 + 8.0 * 2 / 5)  # overhead, two windows of five
    assert round_s(base) < measure_s(base) / 2
    least = finish_s(base, base, 0.0, diagnose=False, n_rounds=2, n_processes=1, exports=False)
    assert least == pytest.approx(2 * 0.1 + 2 * 2 * round_s(base))
