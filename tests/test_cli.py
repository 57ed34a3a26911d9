"""The CLI end to end, as a user runs it."""

import json
import subprocess
import sys
import textwrap

from autotune.cli import main

CFG = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
dataset = [(torch.randn(16), torch.tensor(i % 4)) for i in range(256)]
options = {"measure": {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1}, "n_verify_pairs": 2}
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
    assert sum(1 for line in lines if line.lstrip().startswith("[") and "/4]" in line) >= 4  # one per trial
    assert "(baseline)" in done.stdout and "best " in done.stdout
    assert "baseline vs best" in done.stdout and "samples/s" in done.stdout and "latency p95" in done.stdout
    assert "onnx: model.onnx" in done.stdout and "torchscript: model.pt" in done.stdout  # with their parity
    best = json.loads((out / "best_config.json").read_text())
    assert best["config"]["num_workers"] == 0  # --fix held
    assert best["speedup"]["min"] <= best["speedup"]["median"] <= best["speedup"]["max"]
    header = (out / "trials.csv").read_text().splitlines()[0]
    assert header.startswith("number,status,kind,reason") and "samples_per_s" in header
    assert "why it won: baseline was " in done.stdout and best["diagnosis"]["summary"]
    assert (out / "report.html").is_file() and (out / "report.md").is_file()


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


def test_show_prints_the_summary_from_the_files(finished_run, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["show", str(finished_run)]) == 0
    out = capsys.readouterr().out
    assert "baseline vs best" in out and "latency p95" in out and "why it won: baseline was" in out
    assert "onnx: model.onnx" in out
    assert main(["show", str(finished_run), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    best = json.loads((finished_run / "best_config.json").read_text())
    assert summary["speedup"] == best["speedup"] and summary["diagnosis"] == best["diagnosis"]


def test_show_of_a_directory_without_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["show", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autotune: error: No best_config.json in ") and len(err.splitlines()) == 1


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
    assert summary["trials_by_status"]["ok"] >= 1 and "summary" in summary["diagnosis"]
    assert "[  1/2]" in captured.err  # the progress went to stderr
