"""A phase that fails in the worker is reported as that failure, with its message, and "the
machine was busy" is said only where other processes' load was measured."""

import json
import sys

import torch

import autotune
from autotune.report.summary import busy_note
from autotune.trial.measure import MeasureSettings, is_busy, noise_reason
from tests.models import MLP, classification_data

# Every trial's windows count as disagreeing (max_cov 0), none as beside busy processes.
SPREAD = {"n_windows": 3, "window_s": 0.03, "warmup_batches": 1, "n_remeasure": 0, "max_cov": 0.0,
          "max_others_cpu": 1.0}  # fmt: skip


class _FailsInRounds(MLP):
    """Runs in the trials, raises in the selection and confirmation rounds (a real exception in
    the worker, as a collate missing from that phase raises)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "time_round":
                raise RuntimeError("stack expects each tensor to be equal size (in the rounds only)")
            frame = frame.f_back
        return super().forward(x)


def test_a_confirmation_that_fails_in_the_worker_is_that_failure_not_noise(tmp_path, capsys):
    result = autotune.optimize(
        _FailsInRounds(), classification_data(128), space={"base": None, "batch_size": [16]}, baseline_batch_size=8,
        measure=SPREAD, n_trials=2, n_verify_pairs=2, out_dir=tmp_path, device="cpu", isolation="inprocess",
        export=(),
    )  # fmt: skip
    assert result.verdict == "failed" and not result.claimed, result.claim
    assert "the confirmation rounds failed in the worker" in result.claim
    assert "stack expects each tensor to be equal size (in the rounds only)" in result.claim
    saved = json.loads((tmp_path / "best_config.json").read_text())
    assert saved["speedup"]["verdict"] == "failed" and "in the rounds only" in saved["speedup"]["error"]
    report = (tmp_path / "report.md").read_text()
    assert "in the rounds only" in report
    # Every trial was noisy, by its windows alone: that is not a busy machine.
    assert all(t.user_attrs["noisy"] and not t.user_attrs["busy"] for t in result.study.trials)
    assert "machine was busy" not in report and "machine was busy" not in capsys.readouterr().out
    assert "timed windows disagreed although no other process was measured busy" in report


def test_windows_that_disagree_are_not_a_busy_machine():
    limits = MeasureSettings(max_cov=0.05, max_others_cpu=0.10)
    spread, loaded = {"cov": 0.2, "others_cpu": 0.01}, {"cov": 0.01, "others_cpu": 0.5}
    assert noise_reason(spread, limits) and not is_busy(spread, limits)
    assert noise_reason(loaded, limits) and is_busy(loaded, limits)
    trial = {"ran": True, "samples_per_s": 1.0, "noisy": True}
    assert busy_note([{**trial, "busy": False, "noise": noise_reason(spread, limits)}] * 4, {}).startswith(
        "4 of 4 trials were noisy: their timed windows disagreed"
    )
    assert busy_note([{**trial, "busy": True}] * 4, {}).startswith("The machine was busy")
    # A trial stopped early is not measured again (so not noisy), but its others' load counts.
    stopped = {"ran": True, "samples_per_s": 1.0, "noisy": False, "status": "stopped", "busy": True}
    assert busy_note([{**trial, "busy": True}, stopped], {}).startswith("The machine was busy")
    assert busy_note([{**trial, "busy": True}, {**stopped, "busy": False}], {}) is None
    # Confirmation rounds too spread to claim, on a quiet machine: the claim says so, not "busy".
    assert busy_note([], {"verdict": "noisy", "others_cpu": 0.02, "busy": False}) is None
    assert busy_note([], {"verdict": "noisy", "others_cpu": 0.5, "busy": True}).startswith("The machine was busy")


def test_a_noisy_trial_is_measured_again_only_where_that_could_change_its_place(tmp_path):
    # Every trial's windows disagree (max_cov 0), on a quiet machine (max_others_cpu 1). The
    # baseline is timed again in the confirmation's rounds, beside the pick: measured once. Batches
    # of 64 of a tiny MLP run far faster than the baseline's 8: even the slowest window is over
    # the best, and timing it again cannot change its place.
    again = {**SPREAD, "n_remeasure": 2, "stop_share": 0.0}
    result = autotune.optimize(
        MLP(), classification_data(512), space={"base": None, "batch_size": [8, 64]}, baseline_batch_size=8,
        measure=again, n_trials=2, n_verify_pairs=2, out_dir=tmp_path, device="cpu", isolation="inprocess",
        export=(),
    )  # fmt: skip
    base, fast = (t.user_attrs for t in result.study.trials[:2])
    assert fast["config"]["batch_size"] == 64 and fast["samples_per_s_min"] > base["samples_per_s"]
    assert (base["n_measurements"], fast["n_measurements"]) == (1, 1)
    assert fast["noisy"] and not fast["busy"] and base["noisy"]  # kept, and still said to be noisy
