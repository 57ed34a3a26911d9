"""Which batches a measurement times: each trial and each round its own reproducible draw of the
epoch, the configurations of one round the same draw."""

import functools

import pytest
import torch

from autotune.batching import pad_collate
from autotune.config import Config
from autotune.trial.inference import TrialContext
from autotune.trial.measure import MeasureSettings, measure
from autotune.trial.spec import WorkerSpec
from tests.models import TextEncoder, text_data

FAST = MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=3, n_remeasure=0)
BASE = dict(Config({"batch_size": 8}))


class Recorded(torch.utils.data.Dataset):
    """Text samples that note every index read, so a test sees which batches were timed."""

    def __init__(self, n: int) -> None:
        self.samples = text_data(n)
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        self.read.append(i)
        return self.samples[i]


def _context(data: Recorded) -> TrialContext:
    spec = WorkerSpec(
        model=TextEncoder(),
        dataset=data,
        metric=None,
        device="cpu",
        baseline=BASE,
        val_indices=list(range(16)),
        measure=FAST,
        collate_fn=functools.partial(pad_collate, pad_values={}),
        sequence=True,
    )
    return TrialContext(spec)


def _first_batch(data: Recorded, run) -> tuple[int, ...]:
    """The indices of the first three batches (the warm-up) that ``run`` reads from ``data``."""
    data.read.clear()
    run()
    return tuple(data.read[:24])


def test_each_seed_times_its_own_stretch_and_the_same_seed_the_same():
    data = Recorded(256)
    ctx = _context(data)
    state = ctx.build(BASE)
    draws = {seed: _first_batch(data, lambda s=seed: measure(state, data, FAST, seed=s)) for seed in range(4)}
    assert len(set(draws.values())) == 4, draws
    assert _first_batch(data, lambda: measure(state, data, FAST, seed=2)) == draws[2]


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_trials_and_rounds_draw_fresh_batches_reproducibly():
    data = Recorded(256)
    ctx = _context(data)
    other = dict(Config({"batch_size": 8, "num_threads": 1}))
    # Two configurations' trials read different stretches; the same one again reads its own again.
    first = _first_batch(data, lambda: ctx.run_trial(BASE))
    assert _first_batch(data, lambda: ctx.run_trial(other)) != first
    assert _first_batch(data, lambda: ctx.run_trial(BASE)) == first
    # Rounds: every round a new draw, across calls too (confirmation does not re-read selection's
    # batches); the two configurations of a round read the same batches, so its ratio compares
    # the same work.
    seen = _round_draws(ctx, data, n_calls=2)
    pairs = [seen[i : i + 2] for i in range(0, len(seen), 2)]
    assert len(pairs) == 4 and all(a == b for a, b in pairs)
    assert len({a for a, _ in pairs}) == 4, pairs
    # A fresh worker makes the same draws in the same order.
    assert _round_draws(_context(data), data, n_calls=1) == seen[:4]


def _round_draws(ctx: TrialContext, data: Recorded, n_calls: int) -> list[tuple[int, ...]]:
    """The first three batches each configuration read in each round of ``n_calls`` calls of two rounds."""
    seen: list[tuple[int, ...]] = []
    original = ctx.time_round

    def noting(prepared, diagnose, seed=0, *rest):
        data.read.clear()
        row = original(prepared, diagnose, seed, *rest)
        seen.append(tuple(data.read[:24]))
        return row

    ctx.time_round = noting
    for _ in range(n_calls):
        ctx.rounds([BASE, BASE], 2, 2)
    return seen
