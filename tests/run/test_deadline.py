"""A run's ``timeout`` bounds the whole run, and an in-process trial its ``trial_timeout``."""

import time

import torch

from autotune.config import Config
from autotune.run.stages import finalize_reserve, overrun_margin
from autotune.trial.measure import MeasureSettings
from autotune.trial.runner import InProcessRunner
from autotune.trial.spec import WorkerSpec
from tests.models import MLP, HangAt, classification_data


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
        # Scoring it takes 2 x 250 calls of 50 ms: longer than the margin, so it must be cut off.
        test_dataset=classification_data(2000, seed=1),
        out_dir=tmp_path,
        device="cpu",
        isolation="inprocess",
        export=("torchscript",),
    )
    elapsed = time.monotonic() - started
    assert result.stop_reason in ("timeout", "exhausted")
    assert elapsed <= timeout + overrun_margin(timeout), elapsed
    assert (tmp_path / "best_config.json").is_file()
    assert finalize_reserve(timeout) < timeout
    # What did not fit says so: the held-out scoring was cut off at the deadline.
    assert "error" in result.held_out, result.held_out
