"""The batches a measurement reads: a short epoch read whole, epoch after epoch, and where
its timed windows may end (:mod:`autotune.trial.measure` times them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from autotune.knobs.state import BuildState
from autotune.trial.build import make_loader
from autotune.trial.warmup import compiles_per_shape

# An epoch of at most this many batches is timed whole, its short last batch included, as a
# user's pass over the same samples runs it: on a small dataset that batch can be a third of the
# work (359 samples at batch 256). A longer epoch's last batch is under 1/64 of it and dropped.
WHOLE_EPOCH_BATCHES = 64


def timing_batches(dataset: Any, state: BuildState, warmup_batches: int, seed: int = 0) -> tuple[_Epochs, int]:
    """The endless batches a measurement of ``state`` reads, and how many to run before the clock.

    An epoch of at most :data:`WHOLE_EPOCH_BATCHES` is read whole. Where its batches differ in
    shape (a short last batch, token sequences) and the build compiles per shape (torch.compile,
    TorchScript, cuDNN's autotuner), its first measurement warms up through whole epochs, so
    every shape is compiled before the clock starts and the windows start at an epoch's
    beginning; later measurements of the same build warm up ``warmup_batches`` as usual. A
    longer epoch drops its short last batch, and ``warmup_batches`` are run (:func:`measure`
    first runs one batch of each of its shapes, where they vary: :func:`_shapes_first`).

    Example:
        >>> import torch
        >>> from autotune.trial.build import build
        >>> from autotune.config import Config
        >>> state = build(torch.nn.Linear(8, 2), Config(batch_size=4), "cpu")
        >>> batches, n_warm = timing_batches([torch.randn(8)] * 10, state, 2)
        >>> n_warm, [len(next(batches)) for _ in range(4)]
        (2, [4, 4, 2, 4])
    """
    loader = make_loader(dataset, state, timing=True, seed=seed)
    n_batches = len(loader)
    alike = samples_alike(dataset)
    if n_batches > WHOLE_EPOCH_BATCHES:
        return _Epochs(make_loader(dataset, state, drop_last=True, timing=True, seed=seed), alike=alike), warmup_batches
    vary = batches_vary(dataset, state)
    if vary and compiles_per_shape(state) and not state.info.get("shapes_warmed"):
        # measure() sets shapes_warmed once warmed
        return _Epochs(loader, vary, alike), n_batches * -(-max(warmup_batches, 1) // n_batches)  # whole epochs
    return _Epochs(loader, vary, alike), warmup_batches


def samples_alike(dataset: Any) -> bool:
    """Whether every sample costs what another does to read: samples held in memory (a list or
    tuple of them, a ``TensorDataset``, a ``Subset`` of either). A dataset whose ``__getitem__``
    does the work (opens and decodes files of different sizes) may cost more for some samples
    than for others, so a stretch of a short epoch is not what a pass over it costs.

    Example:
        >>> import torch
        >>> samples_alike([torch.zeros(2)] * 4), samples_alike(torch.utils.data.TensorDataset(torch.zeros(4, 2)))
        (True, True)
        >>> class Files(torch.utils.data.Dataset):
        ...     def __len__(self): return 4
        ...     def __getitem__(self, i): return torch.zeros(2)
        >>> samples_alike(Files())
        False
    """
    from torch.utils.data import Subset, TensorDataset

    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return isinstance(dataset, (list, tuple, TensorDataset))


def batches_vary(dataset: Any, state: BuildState) -> bool:
    """Whether an epoch's batches differ in shape, and so in cost: a short last batch, token
    sequences cut to each batch's longest (trimmed padding, or samples stored at different
    widths), images of different sizes. Batches of one shape cost the same wherever a window
    ends: pre-padded text batched as given needs no whole epochs (the baseline's two windows of
    real MiniLM ran to an epoch's end, 4 s where 2.7 s timed as many batches).

    Example:
        >>> from autotune.knobs.state import BuildExtras, BuildState
        >>> state = BuildState(model=None, device="cpu", batch_size=4, extras=BuildExtras(lengths=[3] * 8, width=16))
        >>> batches_vary(range(8), state), batches_vary(range(9), state)
        (False, True)
        >>> state.padding = "trim"
        >>> batches_vary(range(8), state)
        True
    """
    if len(dataset) % state.batch_size != 0:
        return True
    extras = state.extras
    if extras is None or extras.lengths is None:
        return False
    return extras.width is None or state.padding != "as_given"


class _Epochs:
    """The loader's batches, epoch after epoch, knowing where an epoch ends.

    A new epoch re-creates the loader's iterator, and with it non-persistent workers: that cost
    is part of the pipeline, so it is inside the timed windows. A window that ends at an epoch's
    end holds whole epochs, each with its one restart (see :func:`measure`).
    """

    def __init__(self, loader: Any, vary: bool = True, alike: bool = True) -> None:
        self.loader = loader
        self.n_batches = len(loader)
        self.alike = alike  # every sample costs the same to read (see samples_alike)
        # Batches that differ in cost: in shape (``vary``), or in the reading of their samples.
        self.cost_varies = vary or not alike
        # Whether a window's place in the epoch changes what it times: its batches differ in cost,
        # or each epoch starts the loader's workers again.
        workers = getattr(loader, "num_workers", 0) > 0
        self.persistent = workers and bool(getattr(loader, "persistent_workers", False))
        self.restarts = workers and not self.persistent  # each epoch's first batch waits for new workers
        self.epoch_matters = self.cost_varies or self.restarts
        # Whether a window begun inside an epoch times other work than a pass: the workers read
        # ahead of the warm-up (up to prefetch_factor batches each), or the samples cost unlike.
        self.start_matters = workers or not alike
        self.at_epoch_end = False
        self._it: Iterator[Any] | None = None
        self._left = 0

    def __iter__(self) -> _Epochs:
        return self

    def __next__(self) -> Any:
        if self._left == 0:
            self._it, self._left = iter(self.loader), self.n_batches
        batch = next(self._it)  # type: ignore[arg-type]
        self._left -= 1
        self.at_epoch_end = self._left == 0
        return batch

    @property
    def position(self) -> int:
        """Batches read of the current epoch (0 at an epoch's start or end)."""
        return (self.n_batches - self._left) % max(1, self.n_batches)

    def close(self) -> None:
        """Shut down the loader's workers (a non-persistent iterator's go with it)."""
        self._it = None

    def end_epoch(self) -> None:
        """At an epoch's end, ask the iterator for one batch more, as a user's ``for`` loop
        does: the ``StopIteration`` is where a DataLoader shuts its non-persistent workers down,
        and a user's pass pays for it. Left to the next epoch's start, a window ending there
        never timed it: 20-27 ms of each 0.8-s pass over 160 photos read by 2 workers."""
        if self._it is None or not self.at_epoch_end:
            return
        with contextlib.suppress(StopIteration):
            next(self._it)
        self._it = None

    def begin_epoch(self) -> None:
        """Where a window's start matters (:attr:`start_matters`) over a short epoch, have the
        next batch begin an epoch, as a user's pass does: the workers' start and their first
        batches then fall inside the window, and every sample is read in it. Begun where the
        warm-up left off, a pick's window of JPEG photos read by 2 workers timed 4 batches they
        had read ahead of it, and its claim was 43% over its trials' (and a user's) figure; the
        baseline's (no workers) timed the same few costly photos in every round, 24% under.
        A non-persistent iterator is dropped (its workers shut down before the clock), a
        persistent one read to its epoch's end (so the next pass resets it as a user's does)."""
        if self._left == 0 or not self.start_matters or self.n_batches > WHOLE_EPOCH_BATCHES:
            self.end_epoch()  # a warm-up that ended an epoch: its workers stop before the clock
            return
        if self.persistent:
            for _ in range(self._left):
                next(self._it)  # type: ignore[arg-type]
        else:
            self._it = None
        self._left = 0
        self.at_epoch_end = True


# A window over a short epoch runs on to the epoch's end, but never past this many times its
# minimum length: on a long epoch it ends on the clock.
EPOCH_WINDOW_CAP = 3.0


def _window_done(elapsed_s: float, window_s: float, batches: _Epochs) -> bool:
    """Whether a timed window may end: past its minimum length and, over a short epoch, at the
    epoch's end. A window over 1,024 images at batch 128 was about one epoch, and whether it held
    one restart of the loader's workers or two spread its windows by 6-10%. Where an epoch's
    batches are alike and its restart starts no worker, where a window ends costs nothing: it
    ends on the clock (the plain baseline of real MiniLM, at 0.27 s a batch, ran each window to
    the 1.2-s cap where 0.55 s timed the same work, and was most of a confirmation's rounds)."""
    if elapsed_s < window_s:
        return False
    short = batches.n_batches <= WHOLE_EPOCH_BATCHES and batches.epoch_matters
    return not short or batches.at_epoch_end or elapsed_s >= EPOCH_WINDOW_CAP * window_s


def _aligned_at(batches: _Epochs) -> int | None:
    """Where in the epoch the last window of a short epoch of batches unequal in cost (token
    sequences, a short last batch, samples unlike to read: :func:`samples_alike`) ends: where
    the first began, so the windows time whole epochs and each batch as often as a user's
    passes do. Ended anywhere, they over-weigh the batches
    they happened to cover: on real text, length-sorted groups of 64 measured 9% faster than
    groups of 16 in their trials, and ran 15% slower over whole epochs. ``None`` otherwise."""
    return batches.position if batches.cost_varies and batches.n_batches <= WHOLE_EPOCH_BATCHES else None
