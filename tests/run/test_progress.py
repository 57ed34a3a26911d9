"""Progress of `autotune run`: one plain line per trial off a terminal, a live footer on one."""

import io
import re

from rich.console import Console

from autotune.run.progress import LiveProgress, PlainProgress, make_progress

BASE = {"batch_size": 8, "num_workers": 0}


def _console(terminal: bool = False) -> Console:
    return Console(file=io.StringIO(), width=200, force_terminal=terminal, color_system=None)


def _records():
    return [
        ({"number": 0, "status": "ok", "baseline": True, "samples_per_s": 1000.0, "config": BASE}, 1),
        ({"number": 1, "status": "ok", "samples_per_s": 2500.0, "config": {**BASE, "batch_size": 32}}, 2),
        (
            {
                "number": 2,
                "status": "oom",
                "reason": "OutOfMemoryError: Tried to allocate 64 MiB",
                "config": {**BASE, "batch_size": 64},
            },
            3,
        ),
    ]


def test_plain_progress_prints_one_line_per_trial():
    console = _console()
    progress = make_progress(console, n_trials=4)
    assert type(progress) is PlainProgress
    with progress:
        for rec, n_done in _records():
            progress(rec, n_done, 4)
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"\[  1/4\] +\d+s  trial   0  ok +1,000 samples/s  best trial 1\.00x  \(baseline\)", lines[0])
    assert re.fullmatch(r"\[  2/4\] +\d+s  trial   1  ok +2,500 samples/s  best trial 2\.50x  batch_size=32", lines[1])
    assert re.fullmatch(
        r"\[  3/4\] +\d+s  trial   2  oom +best trial 2\.50x  batch_size=64: OutOfMemoryError: Tried to allocate 64 MiB",
        lines[2],
    )


def test_with_a_timeout_each_line_says_the_time_left():
    console = _console()
    with PlainProgress(console, timeout=600, n_trials=4) as progress:
        rec, n_done = _records()[0]
        progress(rec, n_done, 4)
    assert re.match(r"\[  1/4\] +\d+s  (9:59|10:00) left  trial   0", console.file.getvalue())
    assert progress.budget_text().startswith("3 trials left, ")


def test_quiet_shows_nothing_and_a_terminal_gets_the_live_display():
    assert make_progress(_console(), quiet=True) is None
    console = _console(terminal=True)
    progress = make_progress(console, timeout=60, n_trials=4)
    assert type(progress) is LiveProgress
    with progress:
        for rec, n_done in _records():
            progress(rec, n_done, 4)
        assert progress.last.startswith("trial 2 oom: batch_size=64: OutOfMemoryError")
        footer = Console(file=io.StringIO(), width=200, color_system=None)
        footer.print(progress)
    out = footer.file.getvalue()
    assert "trial 3/4" in out and "1 trial left" in out and "of 1:00 left" in out and "best trial 2.50x" in out
    assert "trial   1  ok" in console.file.getvalue()  # the trial lines scroll above the footer
