"""The examples, run as a user runs them: ``autotune run`` on the cfg.py examples and
``python examples/api.py``, each in a fresh interpreter, checked by the files they write.

The CLI has no flag for the timing windows, so the cfg.py examples run through a three-line
cfg.py that executes the example and shortens its timing (``measure``, ``n_verify_pairs``);
everything else is the example's own and the CLI's flags.
"""

from __future__ import annotations

import csv
import json
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
N_TRIALS = 3
# Seconds for one example run; far above what they take, only there so a hang fails the test.
RUN_TIMEOUT_S = 300

_FAST_CFG = """\
import runpy

globals().update({{k: v for k, v in runpy.run_path({example!r}).items() if not k.startswith("__")}})
options = {{**globals().get("options", {{}}), "measure": {{"n_windows": 2, "window_s": 0.05}}, "n_verify_pairs": 2}}
"""


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, f"{' '.join(args)} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _run_cfg(example: str, tmp_path: Path) -> Path:
    """``autotune run`` the example with short timing windows; return its output directory."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(_FAST_CFG.format(example=str(EXAMPLES / example)))
    out = tmp_path / "out"
    _run(["-m", "autotune", "run", str(cfg), "--trials", str(N_TRIALS), "--space", "quick", "--out", str(out)], ROOT)
    return out


def _check_outputs(out: Path) -> dict[str, Any]:
    """Check best_config.json, trials.csv and study.db agree with each other; return the JSON."""
    result = json.loads((out / "best_config.json").read_text())
    assert result["schema_version"] == 1
    assert isinstance(result["config"]["batch_size"], int) and result["config"]["batch_size"] > 0
    claim = result["speedup"]
    # "slower": the pick was measurably slower in the confirmation rounds, so the baseline stands.
    assert claim["verdict"] in ("speedup", "none", "noisy", "slower") and claim["sentence"]
    # One number everywhere: the speedup is the ratio of the throughputs shown.
    assert claim["speedup"] == pytest.approx(result["best"]["samples_per_s"] / result["baseline"]["samples_per_s"])
    assert 0 < result["baseline"]["metric"] <= 1
    assert result["baseline"]["samples_per_s"] > 0

    with open(out / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{out / 'study.db'}")
    assert len(rows) == len(study.trials) == result["n_trials"]
    # Repeats of a configuration are answered from the earlier trial, not measured again.
    assert sum(1 for r in rows if not r["repeat_of"]) == N_TRIALS
    assert rows[0]["baseline"] == "True" and rows[0]["status"] == "ok"
    return result


@pytest.mark.slow
def test_quickstart_cli(tmp_path: Path) -> None:
    result = _check_outputs(_run_cfg("quickstart.py", tmp_path))
    assert result["baseline"]["metric"] >= 0.9


@pytest.mark.slow  # tests/export/test_digits.py tunes, exports and checks the digits model; this runs the whole CLI
def test_digits_cli(tmp_path: Path) -> None:
    result = _check_outputs(_run_cfg("digits.py", tmp_path))
    guard = result["guard"]
    assert {k: guard[k] for k in ("metric", "max_metric_drop")} == {"metric": "user", "max_metric_drop": 0.01}
    # It fine-tunes on its own train split, never on the samples the guard scores; recorded.
    assert guard["finetune_data"] == "train_dataset"
    # The baseline metric is the model's accuracy on the tuning split.
    assert result["baseline"]["metric"] >= 0.95


@pytest.mark.slow
def test_api_script(tmp_path: Path) -> None:
    # The script itself exits non-zero when the tuned model disagrees with the original.
    _run([str(EXAMPLES / "api.py"), "--out", str(tmp_path / "out"), "--trials", str(N_TRIALS)], tmp_path)
    result = _check_outputs(tmp_path / "out")
    assert result["guard"]["metric"] == "fidelity"


@pytest.mark.slow  # an end-to-end run: outside CI's time, run with -m slow
def test_digits_test_accuracy() -> None:
    # runpy, as autotune.load_config does, but keeping test_dataset, which load_config drops.
    cfg = runpy.run_path(str(EXAMPLES / "digits.py"))
    model, test_dataset = cfg["model"], cfg["test_dataset"]
    assert isinstance(model, torch.nn.Module)
    x = torch.stack([s[0] for s in test_dataset])  # (359, 1, 8, 8)
    y = torch.stack([s[1] for s in test_dataset])  # (359,)
    assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    with torch.inference_mode():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy >= 0.95
    # No sample is both tuned on and reported on.
    tune = {s[0].numpy().tobytes() for s in cfg["dataset"]}
    assert not any(s[0].numpy().tobytes() in tune for s in test_dataset)


@pytest.mark.slow  # tests/deploy load and serve each artifact; this runs the whole example script
def test_deploy_example_serves_every_artifact(tmp_path):
    done = subprocess.run(
        # The run's timeout bounds it whole (search, rounds, export): this test is about serving.
        [sys.executable, "examples/deploy.py", "--out", str(tmp_path / "out"), "--trials", "2", "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for server in ("onnxruntime", "torch.jit", "autotune.load"):
        assert f"{server}: top-1 agreement with the original model 1.000" in done.stdout


@pytest.mark.slow
def test_train_digits_cli(tmp_path: Path) -> None:
    out = _run_cfg("train_digits.py", tmp_path)
    result = json.loads((out / "best_config.json").read_text())
    assert result["mode"] == "train" and result["train"]["effective_batch_size"] == 64
    assert result["guard"] == {"metric": "loss_curve", "loss_tolerance": 0.05}
    with open(out / "trials.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if not r["repeat_of"]]
    assert len(rows) == N_TRIALS and rows[0]["baseline"] == "True" and rows[0]["status"] == "ok"
    for row in rows:
        assert int(row["accumulation_steps"]) * int(row["batch_size"]) == 64
        assert float(row["loss_final"]) < float(row["loss_first"])  # every trial learned
