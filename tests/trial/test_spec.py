"""TrialResult: the one shape of a trial's outcome, to and from Optuna's user attributes."""

import optuna

from autotune.trial.spec import TrialResult


def test_a_result_round_trips_through_a_stored_trial():
    result = TrialResult("oom", "oom", "CUDA out of memory", {"trial_s": 1.5, "config": {"batch_size": 64}})
    study = optuna.create_study(storage="sqlite:///:memory:")
    trial = study.ask()
    for key, value in result.to_attrs().items():
        trial.set_user_attr(key, value)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    assert TrialResult.from_attrs(study.trials[0].user_attrs) == result


def test_a_fault_keeps_what_was_measured_before_it():
    result = TrialResult(metrics={"samples_per_s": 100.0})
    result.fail("infeasible", "guard", "metric dropped")
    assert not result.ok and result.to_attrs()["samples_per_s"] == 100.0 and result.kind == "guard"
