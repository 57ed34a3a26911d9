"""Timed windows over a short epoch hold whole epochs."""

import torch

from autotune.config import Config
from autotune.trial.build import build
from autotune.trial.measure import EPOCH_WINDOW_CAP, MeasureSettings, _window_done, measure, timing_batches


def test_a_window_over_a_short_epoch_ends_at_the_epochs_end():
    """Each epoch re-creates the loader's iterator (and restarts non-persistent workers): a
    window that ends on the clock alone held one restart or two, and its rate with it. Where
    that cannot change what a window times (batches alike, no workers), it ends on the clock."""
    state = build(torch.nn.Linear(4, 2), Config({"batch_size": 4}), "cpu")
    alike, _ = timing_batches([torch.randn(4) for _ in range(20)], state, 0)
    assert not alike.epoch_matters and _window_done(0.41, 0.4, alike)
    workers = build(torch.nn.Linear(4, 2), Config({"batch_size": 4, "num_workers": 1}), "cpu")
    assert timing_batches([torch.randn(4) for _ in range(20)], workers, 0)[0].epoch_matters
    batches, _ = timing_batches([torch.randn(4) for _ in range(18)], state, 0)  # a short last batch
    assert batches.n_batches == 5 and batches.epoch_matters
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


class _FixedCall(torch.nn.Module):
    """30 ms a call whatever the batch: a short batch costs as much as a full one."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        import time

        time.sleep(0.03)
        return self.lin(x)


def test_the_windows_of_batches_unequal_in_cost_time_whole_epochs(monkeypatch):
    """Windows of a short epoch that ended where the clock said over-weighed the batches they
    covered: on real text, length-sorted groups of 64 measured 9% faster than groups of 16 in
    their trials and ran 15% slower over whole epochs, and the search picked them. The last
    window ends where the first began: 17 samples at batch 8 (8, 8, 1) are timed at 17 samples
    per 3 calls, not 9 per 2."""
    import autotune.trial.measure as m

    state = build(_FixedCall(), Config({"batch_size": 8}), "cpu")
    data = [torch.randn(4) for _ in range(17)]
    settings = m.MeasureSettings(n_windows=2, window_s=0.01, warmup_batches=1, n_remeasure=0)
    whole = 17 / (3 * 0.03)
    aligned = m.measure(state, data, settings)
    # Whole epochs: the samples timed are a multiple of the epoch's 17 (counted, not timed; the
    # rate only near an epoch's, since a busy machine adds to every call).
    assert aligned["timed_samples"] % 17 == 0, aligned["timed_samples"]
    assert 0.8 < aligned["samples_per_s"] / whole < 1.05, (aligned["samples_per_s"], whole)
    monkeypatch.setattr(m, "_aligned_at", lambda *a: None)  # as before: windows end on the clock
    clocked = m.measure(state, data, settings)
    assert clocked["timed_samples"] % 17 != 0, clocked["timed_samples"]  # 9 or 16 per 2 calls, say


class _CountedFixedCall(_FixedCall):
    calls = 0

    def forward(self, x):
        _CountedFixedCall.calls += 1
        return super().forward(x)


def test_the_last_window_ends_where_the_first_began_not_at_the_cap():
    """The last window of unequal batches ends where the first began, past its minimum length:
    it also waited for the cap (three times the minimum), so a pick of real text timed its last
    window 1.3 s where 0.4 s held whole epochs, in every round and trial. 17 samples at batch 8
    are 3 calls an epoch (30 ms each); after one warm-up call the first window (0.1 s at least,
    to an epoch's end) times 5 calls and the last one 4 (to where the first began), not 10."""
    import autotune.trial.measure as m

    state = build(_CountedFixedCall(), Config({"batch_size": 8}), "cpu")
    data = [torch.randn(4) for _ in range(17)]
    settings = m.MeasureSettings(n_windows=2, window_s=0.1, warmup_batches=1, n_remeasure=0)
    m.measure(state, data, settings)  # the first measurement warms whole epochs (shapes differ)
    _CountedFixedCall.calls = 0
    m.measure(state, data, settings)
    timed = _CountedFixedCall.calls - settings.warmup_batches
    assert timed % 3 == 0 and timed < 12, timed  # whole epochs, and 9 of them, not 15


def test_a_rounds_first_window_ends_on_the_clock_and_the_last_makes_whole_epochs():
    """A confirmation round's first window of the plain Hugging Face baseline ran on to its
    epoch's end, and its last window, short of its minimum length where the first had begun,
    ran a whole epoch more (3.6 s where 1.8 s held the same batches). In a round the first window
    ends on the clock and the last one makes whole epochs of both. 41 samples at batch 8 are 6
    calls an epoch (30 ms each); after one warm-up call, a first window of 60 ms at least times
    2 calls and the last 4 (to where the first began): one epoch, not two."""
    import autotune.trial.measure as m

    state = build(_CountedFixedCall(), Config({"batch_size": 8}), "cpu")
    data = [torch.randn(4) for _ in range(41)]
    settings = m.MeasureSettings(n_windows=2, window_s=0.06, warmup_batches=1, n_remeasure=0)
    m.measure(state, data, settings)  # the first measurement warms whole epochs (shapes differ)
    _CountedFixedCall.calls = 0
    r = m.measure(state, data, settings, clock_windows=True)
    assert _CountedFixedCall.calls - settings.warmup_batches == 6 and r["n_windows"] == 2


def test_a_warm_builds_model_half_runs_no_epoch_before_its_clock(monkeypatch):
    """The model half of a confirmation round's diagnosis warmed up every batch of the epoch
    again, which the round had just run: the plain Hugging Face baseline's 1.7-s epoch, most
    of its first round's diagnosis. Warm, it runs its warm-up batches alone."""
    import autotune.trial.diagnose as d

    state = build(_CountedFixedCall(), Config({"batch_size": 8}), "cpu")
    batches = [torch.randn(8, 4) for _ in range(6)]
    counts = []
    for every in (True, False):
        _CountedFixedCall.calls = 0
        d.model_samples_per_s(state, batches, 0.01, warmup_batches=1, every=every)
        counts.append(_CountedFixedCall.calls)
    assert counts == [12, 7], counts  # whole cycles timed (6) after 6 warm-up calls, or after 1


class _CountedTokens(torch.nn.Module):
    """10 ms a call over token sequences, counting its calls (in the class: a build copies it)."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 2)

    def forward(self, input_ids, attention_mask):
        import time

        _CountedTokens.calls += 1
        time.sleep(0.01)
        return self.emb(input_ids).mean(1)


def test_windows_over_batches_of_one_shape_end_on_the_clock_not_at_whole_epochs():
    """Pre-padded text batched as given makes batches of one shape, equal in cost: whole
    epochs add nothing but time. The baseline of pre-padded real MiniLM ran its two windows to
    an epoch's end every round (4 s where 2.7 s timed as many batches, in every selection and
    confirmation round). Trimmed to each batch's longest, the same samples differ in cost, and
    their windows still time whole epochs."""
    import autotune.trial.measure as m
    from autotune.batching import lengths_and_width
    from autotune.knobs.state import BuildExtras

    data = []
    for i in range(64):
        n = 4 + i % 12
        mask = torch.zeros(16, dtype=torch.long)
        mask[:n] = 1
        data.append({"input_ids": torch.ones(16, dtype=torch.long) * mask, "attention_mask": mask})
    lengths, width = lengths_and_width(data)
    assert width == 16
    settings = m.MeasureSettings(n_windows=2, window_s=0.02, warmup_batches=1, n_remeasure=0)
    timed = {}
    for padding in ("as_given", "trim"):
        model = _CountedTokens()
        extras = BuildExtras(lengths=lengths, width=width)
        state = build(model, Config({"batch_size": 4, "padding": padding}), "cpu", extras=extras)
        calls = _CountedTokens.calls
        m.measure(state, data, settings)
        timed[padding] = _CountedTokens.calls - calls - settings.warmup_batches
    # Two windows of about 2 batches (10 ms each), not 6 each (the cap, 3 times the minimum
    # length: how long the plain baseline's windows of real MiniLM ran) nor an epoch of 16.
    assert timed["as_given"] < 10, timed
    assert timed["trim"] % 16 == 0, timed  # whole epochs


class _Photos(torch.utils.data.Dataset):
    """Samples read with work in ``__getitem__``, as files decoded there are: the first quarter
    cost ten times the rest (large photos first), which only whole epochs average out."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import time

        time.sleep(0.004 if i < self.n // 4 else 0.0004)
        return torch.full((4,), float(i))


def test_windows_begin_an_epoch_where_workers_or_unlike_samples_make_their_start_matter():
    """A pick's window begun where the warm-up left off timed the batches 2 workers had read
    ahead of it (its JPEG claim 43% over its trials' and a user's figure), and the baseline's
    window, begun after one warm-up batch, timed the same costly photos in every round (24%
    under). Where neither can change what a window times (samples in memory, no workers), the
    warm-up's place stands."""
    from autotune.trial.epochs import samples_alike

    state = build(torch.nn.Linear(4, 2), Config({"batch_size": 4}), "cpu")
    assert samples_alike([torch.randn(4)] * 8) and not samples_alike(_Photos())
    # In memory, no workers: the windows go on from the warm-up.
    alike, _ = timing_batches([torch.randn(4) for _ in range(40)], state, 0)
    for _ in range(3):
        next(alike)
    alike.begin_epoch()
    assert alike.position == 3 and not alike.cost_varies
    # Samples read with work: the next batch begins an epoch, and the windows are aligned on it.
    photos, _ = timing_batches(_Photos(), state, 0)
    for _ in range(3):
        next(photos)
    photos.begin_epoch()
    assert photos.position == 0 and photos.cost_varies and photos.epoch_matters
    assert next(photos)[0, 0] == 0  # the epoch's first sample
    photos.close()
    for persistent in (False, True):
        config = {"batch_size": 4, "num_workers": 1, "persistent_workers": persistent}
        workers = build(torch.nn.Linear(4, 2), Config(config), "cpu")
        batches, _ = timing_batches([torch.full((4,), float(i)) for i in range(40)], workers, 0)
        for _ in range(3):
            next(batches)
        batches.begin_epoch()  # dropped (its workers shut down), or read to its end (persistent)
        assert batches.position == 0 and next(batches)[0, 0] == 0
        batches.close()


def test_a_measurement_of_samples_read_with_work_times_whole_epochs():
    """Over a short epoch of samples unlike to read, the windows together hold whole epochs from
    an epoch's start, so every sample counts as often as in a user's passes, whoever the loader."""
    for config in ({"batch_size": 4}, {"batch_size": 4, "num_workers": 1}):
        state = build(torch.nn.Linear(4, 2), Config(config), "cpu")
        data = _Photos()
        m = measure(state, data, MeasureSettings(n_windows=2, window_s=0.05, warmup_batches=3))
        assert m["timed_samples"] % len(data) == 0 and m["timed_samples"] > 0, (config, m["timed_samples"])


def test_a_window_ending_an_epoch_stops_its_workers_inside_the_clock_as_a_users_pass_does():
    """A user's ``for`` loop ends each pass with the ``StopIteration`` that shuts the
    DataLoader's non-persistent workers down; a window that ended at the epoch's last batch left
    that to the next epoch, outside the clock (20-27 ms of a 0.8-s pass over 160 photos)."""
    import multiprocessing

    from autotune.trial.measure import _window

    state = build(torch.nn.Linear(4, 2), Config({"batch_size": 4, "num_workers": 1}), "cpu")
    batches, _ = timing_batches([torch.full((4,), float(i)) for i in range(16)], state, 0)
    before = {p.pid for p in multiprocessing.active_children()}  # another test's, if any
    try:
        n_samples, n_batches, *_ = _window(state, batches, 0.0, [], set(), align=0)
        assert (n_samples, n_batches) == (16, 4) and batches.at_epoch_end
        alive = [p for p in multiprocessing.active_children() if p.pid not in before and p.is_alive()]
        assert not alive  # the loader's worker stopped inside the window
        assert next(batches)[0, 0] == 0  # the next epoch starts afresh
    finally:
        batches.close()
