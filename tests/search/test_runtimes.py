"""ONNX Runtime and TorchScript compete with torch inside the search, measured the same way."""

import subprocess
import sys
import textwrap

import pytest

import autotune
from tests.models import TinyEncoder, token_data

FAST = {"n_windows": 2, "window_s": 0.1, "warmup_batches": 2, "n_remeasure": 0}


@pytest.mark.slow
def test_cpu_deploy_on_a_transformer_lets_onnxruntime_compete(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(
        textwrap.dedent(f"""
        from tests.models import TinyEncoder, token_data
        model = TinyEncoder()
        dataset = token_data(256)
        options = {{"measure": {FAST!r}, "n_verify_pairs": 2, "export": ()}}
    """)
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "run",
            str(cfg),
            "--space",
            "cpu-deploy",
            "--trials",
            "6",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "out"),
            "--fix",
            "runtime=onnxruntime",
            "--fix",
            "batch_size=32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={"COLUMNS": "220", "PATH": "", "PYTHONPATH": "."},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "fastest trial per runtime" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.lstrip("│ ").startswith(("onnxruntime", "torch"))]
    assert any("onnxruntime" in r and "x" in r for r in rows), done.stdout[-3000:]


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_runtime_trials_are_guarded_like_any_other(tmp_path):
    result = autotune.optimize(
        TinyEncoder(),
        token_data(128),
        space={
            "base": None,
            "runtime": ["torch", "torchscript", "onnxruntime"],
        },  # OpenVINO: tests/deploy/test_openvino.py
        device="cpu",
        out_dir=tmp_path,
        n_trials=3,
        measure=FAST,
        n_verify_pairs=1,
        export=(),
        baseline_batch_size=16,
    )
    by_runtime = {t.user_attrs["config"]["runtime"]: t.user_attrs for t in result.study.trials}
    assert set(by_runtime) == {"torch", "torchscript", "onnxruntime"}
    for attrs in by_runtime.values():
        assert attrs["status"] == "ok", attrs.get("reason")
        assert attrs["metric_drop"] <= 0.01 and attrs["samples_per_s"] > 0
