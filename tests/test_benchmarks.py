"""The benchmark script runs end to end (its numbers are not checked: speed is never asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmark_prints_the_three_tables(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.core", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for header in ("(a) tuned vs baseline", "(b) measurement spread", "(c) per-trial overhead"):
        assert header in proc.stdout
    results = json.loads((tmp_path / "benchmarks.json").read_text())
    assert [row["example"] for row in results["examples"]] == ["quickstart"]
    assert len(results["spread"]["samples_per_s"]) == 5


def test_quick_compression_benchmark_prints_its_table(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compression", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "### lstm:" in proc.stdout
    assert "| setting " in proc.stdout and "| samples/s (x) |" in proc.stdout
    results = json.loads((tmp_path / "compression.json").read_text())
    rows = results["workloads"][0]["rows"]
    assert [r["setting"] for r in rows] == ["baseline", "structured 0.3", "int8_dynamic"]
    assert rows[0]["status"] == "ok"
