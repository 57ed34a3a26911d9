"""Compressed sizes are measured where an objective reads them: a run for speed alone does not
spend seconds of zlib on each build's weights, and its reports leave the row out."""

import csv
import json

import pytest

import autotune
from autotune.report.summary import summary_rows
from tests.models import MLP, classification_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}


def _run(tmp_path, objectives):
    out = tmp_path / "+".join(objectives)
    result = autotune.optimize(
        MLP(), classification_data(256), space={"base": None}, fix={"batch_size": 64}, n_trials=2, out_dir=out,
        export=(), device="cpu", isolation="inprocess", measure=FAST, n_verify_pairs=2, objectives=objectives,
    )  # fmt: skip
    trials = list(csv.DictReader((out / "trials.csv").open()))
    return result, out, trials


def test_a_run_for_speed_measures_no_compressed_size_and_its_reports_leave_the_row_out(tmp_path):
    result, out, trials = _run(tmp_path, ["throughput"])
    measured = [t for t in trials if t["status"] == "ok"]
    assert measured and all(t["size_bytes"] and not t["size_bytes_compressed"] for t in measured)
    labels = [row[0] for row in summary_rows(result.baseline, result.best)]
    assert "model size" in labels and "model size, compressed" not in labels
    assert "compressed" not in (out / "report.md").read_text()


@pytest.mark.parametrize("objectives", [["size"], ["throughput", "latency"]])
def test_a_run_that_reads_sizes_or_shows_a_front_measures_them(tmp_path, objectives):
    result, out, trials = _run(tmp_path, objectives)
    measured = [t for t in trials if t["status"] == "ok"]
    assert measured and all(0 < int(t["size_bytes_compressed"]) <= int(t["size_bytes"]) for t in measured)
    assert "model size, compressed" in [row[0] for row in summary_rows(result.baseline, result.best)]
    saved = json.loads((out / "best_config.json").read_text())
    assert saved["baseline"]["size_bytes_compressed"] > 0
