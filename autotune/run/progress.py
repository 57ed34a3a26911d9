"""Progress of ``autotune run`` in the terminal: a live display on a terminal, one plain line
per trial anywhere else (a pipe, a log file, CI).

Both are context managers and are called by :func:`autotune.optimize` after each trial with
``(trial record, trials measured, n_trials)``; :meth:`PlainProgress.begin` first takes in the
trials a resumed or joined study already holds.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["LiveProgress", "PlainProgress", "display", "make_progress"]


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return (
        f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        if seconds >= 3600
        else f"{seconds // 60}:{seconds % 60:02d}"
    )


class PlainProgress:
    """One line per trial, and one as a slow phase (a compile, a conversion, a calibration) or a
    phase of the finish begins::

        [ 3/30] 0:12/10:00  ok              6,745 samples/s  best 1.82x  amp_dtype=bfloat16
        [ 4/30] 0:14/10:00  compiling                          best 1.82x  compile_mode=default
                0:40/10:00  finishing: confirmation

    One counter (trials measured, the running one counted), one time format (elapsed, and of the
    run's time bound where it has one).

    Args:
        console: A ``rich`` console to print on.
        timeout: The run's time bound in seconds (``budget`` or ``timeout``); ``None`` for none.
        n_trials: The trial budget.
    """

    # Phases worth a line of their own off a terminal: those that run for seconds with nothing else to show.
    SLOW = ("compiling", "converting", "calibrating", "pruning")
    # Whether a slow phase prints its line (the live display shows every phase in its footer instead).
    phase_lines = True

    def __init__(self, console: Any, timeout: float | None = None, n_trials: int = 0) -> None:
        self.console, self.timeout = console, timeout
        self.start = time.monotonic()
        self.baseline: float | None = None
        self.baseline_config: dict[str, Any] = {}
        self.best = 0.0
        self.n_done, self.n_total = 0, n_trials
        self.last = "measuring the baseline"
        self.running: tuple[str, str, float] | None = None  # (what runs, its phase, since when)
        self._said: set[tuple[int, str]] = set()  # (trial, phase) given a line already
        self.finishing: str | None = None  # why the search stopped, once it has

    def __enter__(self) -> PlainProgress:
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    @property
    def best_text(self) -> str:
        # The trials' own ratio, before any confirmation: not the claim.
        return f"best {self.best / self.baseline:.2f}x" if self.baseline else "best -"

    def clock(self) -> str:
        """Elapsed, and of the time bound where there is one: ``0:12/10:00``."""
        elapsed = _clock(time.monotonic() - self.start)
        return elapsed if self.timeout is None else f"{elapsed}/{_clock(self.timeout)}"

    def budget_text(self) -> str:
        """What is left: trials (until the search stopped), and time when there is a bound."""
        if self.finishing is not None:
            left = f"search stopped ({self.finishing}): finishing"
        else:
            n_left = max(0, self.n_total - self.n_done)
            left = f"{n_left} trial{'' if n_left == 1 else 's'} left"
        if self.timeout is not None:
            left += f", {_clock(self.timeout - (time.monotonic() - self.start))} of {_clock(self.timeout)} left"
        return left

    def header(self, env: Any, space: Any, opts: Any, out: Any) -> None:
        """The run's first lines: the device, the data, the space, the output folder and the bound."""
        if env.gpu_name:
            what = env.gpu_name
        else:
            from autotune.env import cpu_model

            model = cpu_model() or "CPU"
            what = f"{model}, {env.cpu_threads} threads, {env.cpu_capability}{', bf16' if env.bf16 else ''}"
        preset = opts.space if isinstance(opts.space, str) else "custom"
        searched = sum(len(v) > 1 for v in space.values.values())
        bound = f"{opts.n_trials} trials"
        if opts.limit_s is not None:
            kind = "budget" if opts.budget is not None and opts.budget == opts.limit_s else "timeout"
            bound += f" or {_clock(opts.limit_s)} ({kind}), whichever ends first"
        lines = [
            f"autotune: {opts.mode} on {env.device} ({what}); results in {out}/",
            f"space: {searched} knobs searched, up to {space.size():,} configurations ({preset}); bound: {bound}",
        ]
        for line in lines:
            self.console.print(line, highlight=False, soft_wrap=True, markup=False)

    def begin(self, study: Any, n_trials: int, *, resume: bool = False) -> None:
        """Take in the trials ``study`` holds before this run measures any: the baseline (whose
        knobs the lines leave out), the best so far and the count; say what was kept, if any."""
        from autotune.record import trial_record
        from autotune.search.record import n_measured

        for rec in (trial_record(t) for t in study.get_trials(deepcopy=False)):
            if rec.get("status") and "config" in rec:  # a finished trial, not one queued
                self._fold(rec)
        self.n_done, self.n_total = n_measured(study), n_trials
        if self.n_done:
            verb, what = ("resuming", "kept") if resume else ("joining", "measured so far")
            n_left = max(0, n_trials - self.n_done)
            self.last = f"{verb}: {self.n_done} trial{'' if self.n_done == 1 else 's'} {what}, {n_left} to go"
            self.console.print(self.last, highlight=False, soft_wrap=True, markup=False)

    def _fold(self, rec: dict[str, Any]) -> None:
        """Take the baseline's configuration and speed, and the best speed, from one record."""
        sps = rec.get("samples_per_s")
        if rec.get("baseline"):
            self.baseline_config = dict(rec.get("config", {}))
            if rec.get("status") == "ok":
                self.baseline = sps
        if rec.get("status") == "ok" and sps:
            self.best = max(self.best, sps)

    def changes(self, config: dict[str, Any]) -> str:
        """The knobs of ``config`` that differ from the baseline's."""
        return " ".join(f"{k}={v}" for k, v in config.items() if self.baseline_config.get(k) != v)

    def _update(self, rec: dict[str, Any], n_done: int, n_total: int) -> str:
        """Fold one trial into the state; return what it changed or why it failed."""
        self.n_done, self.n_total = n_done, n_total
        self.running = None
        self._fold(rec)
        changed = self.changes(rec.get("config", {}))
        noisy = f" [noisy: {rec['noise']}]" if rec.get("noisy") else ""
        if rec.get("status") == "ok":
            return ("(baseline)" if rec.get("baseline") else changed) + noisy
        return f"{changed}: {rec.get('reason')}" if changed else str(rec.get("reason"))

    def counter(self) -> str:
        """``[ 3/30]``: trials measured (the running one counted)."""
        return f"[{self.n_done:>2}/{self.n_total}]"

    def line(self, rec: dict[str, Any], detail: str) -> str:
        """The trial's line, with rich markup for its status."""
        from rich.markup import escape

        status = rec.get("status", "?")
        if rec.get("kind") == "screened":  # refused before it ran, not a fault
            status = "screened"
        style = {"ok": "green", "infeasible": "yellow", "stopped": "dim", "skipped": "dim", "screened": "dim"}
        style = style.get(status, "red")
        sps = rec.get("samples_per_s")
        speed = f"{sps:>10,.0f} samples/s" if sps else " " * 20
        # escape: the detail's "[noisy: ...]" and reasons are text, not rich markup to drop
        return (
            f"{escape(self.counter())} {self.clock()}  [{style}]{status:<10}[/{style}] {speed}  "
            f"{self.best_text}  {escape(detail)}"
        )

    def __call__(self, rec: dict[str, Any], n_done: int, n_total: int) -> None:
        detail = self._update(rec, n_done, n_total)
        self.console.print(self.line(rec, detail), highlight=False, soft_wrap=True)

    def phase(self, phase: str, trial: tuple[int, dict[str, Any]] | None = None) -> None:
        """The running trial (``trial``: its number and configuration) entered ``phase``."""
        if trial is None or self.finishing is not None:
            return
        what = self.changes(trial[1]) or "(baseline)"
        if self.running is not None and self.running[:2] == (what, phase):
            return  # the same phase again: said once
        self.running = (what, phase, time.monotonic())
        if (trial[0], phase) in self._said:
            return  # a measurement repeated within the trial: its warm-up compiles nothing new
        self._said.add((trial[0], phase))
        if self.phase_lines and any(phase.startswith(p) for p in self.SLOW):
            self.console.print(
                f"[{self.n_done + 1:>2}/{self.n_total}] {self.clock()}  {phase:<10} {' ' * 20}  {self.best_text}  {what}",
                highlight=False,
                soft_wrap=True,
                markup=False,
            )

    def finish_phase(self, phase: str) -> None:
        """A phase of the finish (selection, confirmation, export, profile) begins."""
        self.running = None
        self.last = f"finishing: {phase}"
        self.console.print(f"{' ' * len(self.counter())} {self.clock()}  finishing: {phase}", highlight=False,
                           soft_wrap=True, markup=False)  # fmt: skip

    def search_done(self, reason: str | None) -> None:
        """The search stopped (``reason``: ``n_trials``, ``converged``, ``budget``, ...): no more trials count down."""
        self.finishing = reason or "done"
        self.running = None


class LiveProgress(PlainProgress):
    """On a terminal: the trial lines scroll above a live footer with the bar, the clock and
    what is left of the bound, the best speedup so far, and what runs now (the trial's changes
    and its phase, or the finish's phase)."""

    def __init__(self, console: Any, timeout: float | None = None, n_trials: int = 0) -> None:
        super().__init__(console, timeout, n_trials)
        self._live: Any = None
        self.phase_lines = False

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        head = Table.grid(padding=(0, 2))
        head.add_row(
            Text(f"{self.n_done}/{self.n_total or '?'} trials", style="bold"),
            ProgressBar(total=max(1, self.n_total), completed=self.n_done, width=30, complete_style="green"),
            Text(self.clock()),
            Text(self.budget_text()),
            Text(self.best_text, style="bold green" if self.baseline and self.best > self.baseline else ""),
        )
        if self.running is not None:
            what, phase, since = self.running
            now = f"now: {phase} ({_clock(time.monotonic() - since)}): {what}"
        else:
            now = f"last: {self.last}"
        return Group(head, Text(now, overflow="ellipsis", no_wrap=True, style="dim"))

    def __enter__(self) -> LiveProgress:
        from rich.live import Live

        super().__enter__()
        # Redrawn four times a second, so the clocks run between trials.
        self._live = Live(self, console=self.console, refresh_per_second=4, transient=True)
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def __call__(self, rec: dict[str, Any], n_done: int, n_total: int) -> None:
        detail = self._update(rec, n_done, n_total)
        status = "screened" if rec.get("kind") == "screened" else rec.get("status")
        self.last = f"{status}: {detail}"
        self.console.print(self.line(rec, detail), highlight=False, soft_wrap=True)


def make_progress(
    console: Any, *, timeout: float | None = None, n_trials: int = 0, quiet: bool = False
) -> PlainProgress | None:
    """The display for ``console``: live on a terminal, plain lines elsewhere, none when quiet."""
    if quiet:
        return None
    if console.is_terminal and not console.is_dumb_terminal:
        return LiveProgress(console, timeout, n_trials)
    return PlainProgress(console, timeout, n_trials)


def display(progress: Any, *, timeout: float | None = None, n_trials: int = 0) -> Any:
    """What ``optimize(progress=...)`` shows: for ``True`` the display of :func:`make_progress`
    on stderr (plain lines when it is a file or a pipe), for ``False`` or ``None`` nothing, and
    a function is called as it is.

    Raises:
        ConfigError: ``progress`` is none of these.
    """
    from autotune.errors import ConfigError

    if progress is None or progress is False:
        return None
    if progress is True:
        from rich.console import Console

        return make_progress(Console(stderr=True), timeout=timeout, n_trials=n_trials)
    if not callable(progress):
        raise ConfigError(
            f"`progress` must be True (show it), False (show nothing) or a function(record, n_done, n_trials), "
            f"but got {progress!r}."
        )
    return progress
