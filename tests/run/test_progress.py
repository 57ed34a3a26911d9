"""Progress of `autotune run`: one plain line per trial off a terminal, a live footer on one."""

import io
import re

import pytest
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
    # One counter (trials measured), one time format (m:ss).
    assert re.fullmatch(r"\[ 1/4\] 0:0\d  ok +1,000 samples/s  best 1\.00x  \(baseline\)", lines[0])
    assert re.fullmatch(r"\[ 2/4\] 0:0\d  ok +2,500 samples/s  best 2\.50x  batch_size=32", lines[1])
    assert re.fullmatch(
        r"\[ 3/4\] 0:0\d  oom +best 2\.50x  batch_size=64: OutOfMemoryError: Tried to allocate 64 MiB",
        lines[2],
    )


def test_a_noisy_trial_and_a_bracketed_reason_keep_their_text():
    console = _console()
    with PlainProgress(console, n_trials=4) as progress:
        progress(_records()[0][0], 1, 4)
        progress({**_records()[1][0], "noisy": True, "noise": "cov 0.12 > 0.05"}, 2, 4)
        progress({"number": 3, "status": "error", "reason": "[bold] is not markup", "config": BASE}, 3, 4)
    lines = console.file.getvalue().splitlines()
    assert lines[1].endswith("  batch_size=32 [noisy: cov 0.12 > 0.05]")
    assert lines[2].endswith("  [bold] is not markup")


def test_a_trial_refused_after_screening_reads_screened_not_error():
    console = _console()
    with PlainProgress(console, n_trials=4) as progress:
        progress(_records()[0][0], 1, 4)
        reason = "left out after screening: measured 0.63x with num_threads=1"
        progress({"number": 1, "status": "error", "kind": "screened", "reason": reason,
                  "config": {**BASE, "num_threads": 1}}, 1, 4)  # fmt: skip
    line = console.file.getvalue().splitlines()[1]
    assert re.search(r"\] 0:0\d  screened +best 1\.00x", line), line
    assert "error" not in line


def test_with_a_time_bound_each_line_says_the_time_of_it():
    console = _console()
    with PlainProgress(console, timeout=600, n_trials=4) as progress:
        rec, n_done = _records()[0]
        progress(rec, n_done, 4)
    assert re.match(r"\[ 1/4\] 0:0\d/10:00  ok", console.file.getvalue())
    assert progress.budget_text().startswith("3 trials left, ")
    progress.search_done("converged")  # a stopped search stops counting down trials
    assert progress.budget_text().startswith("search stopped (converged): finishing, ")


def test_a_slow_phase_gets_a_line_naming_the_running_trial_and_the_finish_its_phases():
    console = _console()
    with PlainProgress(console, timeout=600, n_trials=4) as progress:
        progress(*_records()[0][:1], 1, 4)
        progress.phase("building", (1, {**BASE, "compile_mode": "default"}))  # quick: no line
        progress.phase("compiling", (1, {**BASE, "compile_mode": "default"}))
        progress.phase("compiling", (1, {**BASE, "compile_mode": "default"}))  # said again: one line
        progress.phase("timing", (1, {**BASE, "compile_mode": "default"}))
        progress.phase("compiling", (1, {**BASE, "compile_mode": "default"}))  # measured again: still one line
        progress.phase("timing", (1, {**BASE, "compile_mode": "default"}))
        progress.phase("timing", None)  # a call's phase (the confirmation rounds): not a trial's
        progress.search_done("n_trials")
        progress.finish_phase("confirmation")
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert re.fullmatch(r"\[ 2/4\] 0:0\d/10:00  compiling +best 1\.00x  compile_mode=default", lines[1])
    assert re.fullmatch(r" +0:0\d/10:00  finishing: confirmation", lines[2])


def test_quiet_shows_nothing_and_a_terminal_gets_the_live_display():
    assert make_progress(_console(), quiet=True) is None
    console = _console(terminal=True)
    progress = make_progress(console, timeout=60, n_trials=4)
    assert type(progress) is LiveProgress
    with progress:
        for rec, n_done in _records():
            progress(rec, n_done, 4)
        assert progress.last.startswith("oom: batch_size=64: OutOfMemoryError")
        footer = Console(file=io.StringIO(), width=200, color_system=None)
        footer.print(progress)
        out = footer.file.getvalue()
        assert "3/4 trials" in out and "1 trial left" in out and "of 1:00 left" in out and "best 2.50x" in out
        progress.phase("calibrating", (3, {**BASE, "quantization": "int8_dynamic"}))
        footer.print(progress)  # the footer names what runs now, and its phase
        assert "now: calibrating (0:00): quantization=int8_dynamic" in footer.file.getvalue()
    assert "] 0:00/1:00  ok" in console.file.getvalue()  # the trial lines scroll above the footer


FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}
NOISY = r"( \[noisy: [^]]*\])?"  # a shared machine can make any measurement noisy
# A trial far below the best so far stops after its first window, and its line says so.
STOPPED = r"(: stopped after 1 of \d+ windows: .*)?"
TRIAL_LINE = re.compile(r"\[ *(\d+)/(\d+)\] [\d:/]+  (\w+) .*  (best [\d.]+x|best -)  (.*)$")


def _tiny(out_dir, **kwargs):
    import autotune
    from tests.models import MLP, classification_data

    args = dict(
        space={"base": None, "batch_size": [8, 16, 32]},
        out_dir=out_dir,
        baseline_batch_size=8,
        measure=FAST,
        device="cpu",
        isolation="inprocess",
        n_verify_pairs=2,
        n_finalists=1,
        export=(),
    )
    return autotune.optimize(MLP(), classification_data(), **{**args, **kwargs})


def _trial_lines(text):
    return [m for m in map(TRIAL_LINE.match, text.splitlines()) if m]


@pytest.mark.slow  # the plain lines are unit-tested above; resume by tests/search/test_study.py
def test_optimize_off_a_terminal_prints_plain_lines_and_a_resumed_run_says_what_it_kept(tmp_path, capsys):
    _tiny(tmp_path, n_trials=2)
    err = capsys.readouterr().err  # captured: not a terminal
    lines = _trial_lines(err)
    assert [m.group(1, 2) for m in lines] == [("1", "2"), ("2", "2")], err
    assert re.fullmatch(rf"\(baseline\){NOISY}", lines[0].group(5)), err
    # Only the knobs that differ from the baseline: the other 26 stay out of the line.
    assert re.fullmatch(rf"batch_size=(16|32){NOISY}{STOPPED}", lines[1].group(5)), err
    assert "resuming" not in err

    _tiny(tmp_path, n_trials=3, resume=True)
    err = capsys.readouterr().err
    assert "resuming: 2 trials kept, 1 to go" in err.splitlines(), err
    lines = _trial_lines(err)
    assert [m.group(1, 2) for m in lines] == [("3", "3")], err
    # The kept baseline is the reference: the best so far is known, one knob is named.
    assert lines[0].group(4).startswith("best ")
    assert re.fullmatch(rf"batch_size=(16|32){NOISY}{STOPPED}", lines[0].group(5)), err


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_progress_false_prints_nothing_and_a_wrong_value_is_refused(tmp_path, capsys):
    import autotune

    _tiny(tmp_path, n_trials=2, progress=False)
    out, err = capsys.readouterr()
    assert not _trial_lines(out + err) and "samples/s" not in out + err
    with pytest.raises(autotune.ConfigError, match=r"`progress` must be True .* but got 'yes'"):
        _tiny(tmp_path / "b", progress="yes")


def test_the_header_names_the_device_the_space_the_folder_and_the_bound():
    import torch

    from autotune.run.options import Options
    from autotune.run.plan import plan

    opts = Options()  # no n_trials, timeout or budget: the default bound, said
    assert (opts.n_trials, opts.budget) == (30, 600.0)
    env, _, space = plan(torch.nn.Linear(4, 2), [(torch.randn(4), 0)] * 64, **opts.plan_args())
    console = _console()
    PlainProgress(console).header(env, space, opts, "autotune-out")
    first, second = console.file.getvalue().splitlines()
    assert first.startswith("autotune: inference on cpu (") and first.endswith("results in autotune-out/")
    searched = sum(len(v) > 1 for v in space.values.values())
    assert second.startswith(f"space: {searched} knobs searched, up to {space.size():,} configurations (default)")
    assert second.endswith("bound: 30 trials or 10:00 (budget), whichever ends first")
    assert Options(n_trials=5).budget is None and Options(timeout=60).budget is None  # a bound given is the bound
