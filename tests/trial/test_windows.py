"""Timed windows over a short epoch hold whole epochs."""

import torch

from autotune.config import Config
from autotune.trial.build import build
from autotune.trial.measure import EPOCH_WINDOW_CAP, _window_done, timing_batches


def test_a_window_over_a_short_epoch_ends_at_the_epochs_end():
    """Each epoch re-creates the loader's iterator (and restarts non-persistent workers): a
    window that ends on the clock alone held one restart or two, and its rate with it."""
    state = build(torch.nn.Linear(4, 2), Config({"batch_size": 4}), "cpu")
    batches, _ = timing_batches([torch.randn(4) for _ in range(20)], state, 0)
    assert batches.n_batches == 5
    ends = []
    for _ in range(12):
        next(batches)
        ends.append(batches.at_epoch_end)
    assert ends == [False, False, False, False, True] * 2 + [False, False]
    batches.close()
    # Past the minimum length, a short epoch's window waits for the epoch's end ...
    batches.at_epoch_end = False
    assert not _window_done(0.5, 0.4, batches)
    batches.at_epoch_end = True
    assert _window_done(0.5, 0.4, batches) and not _window_done(0.3, 0.4, batches)
    # ... but not forever.
    batches.at_epoch_end = False
    assert _window_done(EPOCH_WINDOW_CAP * 0.4, 0.4, batches)


def test_a_long_epochs_window_ends_on_the_clock():
    state = build(torch.nn.Linear(4, 2), Config({"batch_size": 1}), "cpu")
    batches, _ = timing_batches([torch.randn(4) for _ in range(200)], state, 0)
    next(batches)
    assert not batches.at_epoch_end and _window_done(0.41, 0.4, batches)
    batches.close()
