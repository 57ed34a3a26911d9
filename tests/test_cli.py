"""The CLI end to end, as a user runs it."""

import html
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune.cli import main

CFG = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
dataset = [(torch.randn(16), torch.tensor(i % 4)) for i in range(256)]
options = {"measure": {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}, "n_verify_pairs": 2}
"""


def test_spaces_lists_every_preset(capsys):
    assert main(["spaces"]) == 0
    out = capsys.readouterr().out
    for name in ("default", "quick", "cpu", "gpu", "shrink", "cpu-deploy"):
        assert f"{name}:" in out


def test_dry_run_prints_the_space_with_reasons(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CFG)
    assert main(["run", str(cfg), "--dry-run", "--device", "cpu", "--fix", "batch_size=64"]) == 0
    out = capsys.readouterr().out
    assert "search space" in out and "amp_dtype" in out
    assert "float16 autocast is offered on CUDA devices only" in out
    assert "uses CUDA graphs" in out
    assert not (tmp_path / "autotune-out").exists()  # nothing measured, nothing written


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_run_prints_progress_and_table_and_writes_files(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(textwrap.dedent(CFG))
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "run",
            str(cfg),
            "--trials",
            "4",
            "--space",
            "quick",
            "--out",
            str(out),
            "--seed",
            "3",
            "--fix",
            "num_workers=0",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", "PATH": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("autotune: inference on cpu") and "bound: 4 trials" in lines[1], lines[:2]
    assert sum(1 for line in lines if line.lstrip().startswith("[") and "/4]" in line) >= 4  # one per trial
    assert "(baseline)" in done.stdout and "best " in done.stdout
    # The ending: a few lines from the claim, not the whole result (that is --verbose / show).
    ending = lines[next(i for i, line in enumerate(lines) if line.startswith("speedup: ")) :]
    assert len(ending) <= 12, ending
    assert "model.onnx (onnx, parity ok)" in done.stdout and "model.pt (torchscript, parity ok)" in done.stdout
    assert "best config:" not in done.stdout and "where the time goes" not in done.stdout
    best = json.loads((out / "best_config.json").read_text())
    assert best["config"]["num_workers"] == 0  # --fix held
    claim = best["speedup"]
    assert claim["verdict"] in ("speedup", "none", "noisy") and claim["sentence"] in " ".join(done.stdout.split())
    if claim["method"] == "confirmation rounds":
        assert claim["low"] <= claim["speedup"] <= claim["high"]
    header = (out / "trials.csv").read_text().splitlines()[0]
    assert header.startswith("number,status,kind,reason") and "samples_per_s" in header
    diagnosis = best["diagnosis"]
    assert diagnosis.get("summary") or diagnosis.get("fault")
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    # The default strategy is staged: the phases, with their trials, are in the files and the
    # report, and they count the measured trials the progress lines counted.
    story = best["search"]
    assert story["strategy"] == "staged" and story["phases"][0] == {**story["phases"][0], "phase": "baseline"}
    assert sum(p["n_trials"] for p in story["phases"]) == 4
    assert story["found"]["trial"] == best["trial"]
    assert "## How the search went" in (out / "report.md").read_text()


def test_report_writes_both_files_of_a_finished_run(finished_run, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    for name in ("report.html", "report.md"):
        (out / name).unlink()
    assert main(["report", str(out)]) == 0
    assert "report.html" in capsys.readouterr().out
    assert (out / "report.html").stat().st_size > 1_000_000  # plotly.js is inside
    assert (out / "report.md").read_text().startswith("# autotune report")


def test_the_end_of_a_run_is_a_few_lines_and_quiet_is_one(finished_run, monkeypatch):
    """What `autotune run` prints when it ends: the claim, the metric, what changed, the
    artifacts, why it stopped, where the rest is and how to use it; `--quiet`: the claim alone."""
    import io

    from rich.console import Console

    from autotune.cli.printing import _print_ending
    from autotune.report.data import load_result

    result = load_result(finished_run)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    _print_ending(console, result)
    lines = console.file.getvalue().splitlines()
    assert 6 <= len(lines) <= 12, lines
    assert lines[0].startswith("speedup: ") and result.claim in lines[0]
    changed = next(line for line in lines if line.startswith("changed: "))
    saved = json.loads((finished_run / "best_config.json").read_text())
    for knob, value in saved["config"].items():  # exactly the knobs off the baseline, no others
        assert (f"{knob} {saved['baseline_config'][knob]} -> {value}" in changed) == (
            value != saved["baseline_config"][knob]
        ), changed
    assert any(line.startswith("artifacts: ") and "model.onnx (onnx, parity ok)" in line for line in lines)
    assert any(line.startswith("stopped: ") for line in lines)
    assert any(f"autotune show {finished_run}" in line for line in lines)
    assert any(f'autotune.apply(model, "{finished_run}")' in line for line in lines)
    quiet = Console(file=io.StringIO(), width=200, color_system=None)
    _print_ending(quiet, result, quiet=True)
    assert quiet.file.getvalue().splitlines() == [lines[0], f"results in {finished_run}/"]


def test_show_prints_the_summary_from_the_files(finished_run, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["show", str(finished_run)]) == 0
    out = capsys.readouterr().out
    assert "baseline vs best" in out and "latency p95" in out and "why it won: " in out
    assert "onnx: model.onnx" in out
    assert "where the time goes (winner): " in out and "ui.perfetto.dev" in out
    assert main(["show", str(finished_run), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    best = json.loads((finished_run / "best_config.json").read_text())
    assert summary["speedup"] == best["speedup"] and summary["diagnosis"] == best["diagnosis"]


def test_show_and_both_reports_give_one_trial_count(finished_run, capsys, monkeypatch):
    # The progress lines count measured trials against n_trials; show and the reports say the
    # same number, not the study's entries (repeats answered from an earlier trial included).
    from autotune.report.data import load_run
    from autotune.report.summary import trials_sentence
    from autotune.search.study import n_measured

    monkeypatch.setenv("COLUMNS", "400")
    run = load_run(finished_run)
    n = n_measured(run.study)
    sentence = trials_sentence(run.trial_counts())
    assert sentence.startswith(f"{n} trial{'' if n == 1 else 's'} measured")
    assert main(["show", str(finished_run)]) == 0
    assert f"trials: {sentence}" in " ".join(capsys.readouterr().out.split())
    assert main(["show", str(finished_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_trials"] == n
    assert sentence in (finished_run / "report.md").read_text()
    assert html.escape(sentence) in (finished_run / "report.html").read_text()


def test_show_of_a_directory_without_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["show", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autotune: error: No best_config.json in ") and len(err.splitlines()) == 1


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_run_json_prints_only_the_result_as_json(tmp_path, capsys):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(textwrap.dedent(CFG))
    out = tmp_path / "out"
    args = ["run", str(cfg), "--json", "--trials", "2", "--space", "quick", "--out", str(out)]
    args += ["--fix", "num_workers=0", "--device", "cpu", "--isolation", "inprocess", "--export", "none"]
    assert main(args) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # nothing else on stdout
    assert summary["config"] == json.loads((out / "best_config.json").read_text())["config"]
    assert summary["trials_by_status"]["ok"] >= 1
    assert "summary" in summary["diagnosis"] or "fault" in summary["diagnosis"]
    assert "[  1/2]" in captured.err  # the progress went to stderr


NONE_CFG = """
import torch
from torch import nn


class Forgetful(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x):
        self.linear(x)  # no return: the forward returns None


model = Forgetful()
dataset = [torch.randn(16) for _ in range(64)]
"""


def test_a_forward_that_returns_none_ends_in_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(textwrap.dedent(NONE_CFG))
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "run", str(cfg), "--out", str(tmp_path / "out"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "returned None" in err[0] and "Traceback" not in done.stdout + done.stderr


def test_an_out_that_is_a_file_is_bad_input_before_any_work(tmp_path, capsys):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(textwrap.dedent(CFG))
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    assert main(["run", str(cfg), "--out", str(taken), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a file" in err and "--out" in err
    # Below a file: the directory cannot be made.
    assert main(["run", str(cfg), "--out", str(taken / "sub"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Cannot create the output directory" in err
    assert not (tmp_path / "autotune-out").exists()


def test_join_without_storage_is_refused_in_one_line_before_any_work(tmp_path, capsys):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(textwrap.dedent(CFG))
    out = tmp_path / "results-node1"
    assert main(["run", str(cfg), "--join", "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--join" in err and "--storage" in err
    assert not out.exists()  # refused before the output directory and its own study.db were made


def test_show_status_and_the_result_report_one_speedup(finished_run, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    best = json.loads((finished_run / "best_config.json").read_text())
    claim = best["speedup"]
    assert main(["status", str(finished_run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["groups"][0]["claim"] == claim
    assert main(["status", str(finished_run)]) == 0
    assert f"finished run: {claim['sentence']}" in " ".join(capsys.readouterr().out.split())
    assert main(["show", str(finished_run)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert claim["sentence"] in shown
    report = (finished_run / "report.md").read_text()
    assert claim["sentence"] in report


def test_status_without_an_argument_reads_autotune_out(finished_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 2  # nothing there yet: one line that says where it looked
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "autotune-out" in err and "--storage" in err
    (tmp_path / "autotune-out").symlink_to(finished_run, target_is_directory=True)
    assert main(["status", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(["status", str(finished_run), "--json"]) == 0
    named = json.loads(capsys.readouterr().out)
    assert default["groups"] == named["groups"] and default["groups"][0]["n_measured"] >= 1
    assert main(["status", "autotune-out", "--storage", "sqlite:///x.db"]) == 2  # both: refused


def test_version_prints_the_installed_distributions_version(capsys):
    from importlib import metadata

    from autotune.cli import _DISTRIBUTION

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the backport autotune requires there
        import tomli as tomllib
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    assert _DISTRIBUTION == project["name"]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"autotune {metadata.version(project['name'])}\n"
    # As a user runs it: the console script's module, in a fresh process.
    shown = subprocess.run([sys.executable, "-m", "autotune", "--version"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip() == f"autotune {metadata.version(project['name'])}"
