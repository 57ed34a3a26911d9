"""The benchmarks run end to end (their numbers are not checked: speed is never asserted), and the
GPU suite's models and data sets work at tiny sizes on the CPU."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmarks.run
from benchmarks import models

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_cpu_smoke_prints_every_table_and_writes_json(tmp_path):
    proc = run("-m", "benchmarks.run", "--suite", "cpu", "--smoke", "--out", str(tmp_path))
    titles = (
        "### Part 1: tuned vs baseline vs expert",
        "### Search space: quickstart, 4 configurations",
        "### Search efficiency:",
        "### Measurement spread: digits baseline, 3 runs",
        "### Per-trial overhead",
        "### Training step, samples/s",
    )
    tables = (tmp_path / "cpu.md").read_text()
    for title in titles:
        assert title in proc.stdout and title in tables
    assert "total wall time:" in proc.stdout
    doc = json.loads((tmp_path / "cpu.json").read_text())
    (row,) = doc["compare"]
    assert row["workload"] == "digits" and set(row["ratios"]) >= {"tuned/baseline"}
    assert len(row["rounds"]) == 1
    assert doc["search"]["n_configs"] == 4 and not doc["search"]["cached"]
    for sampler in ("tpe", "random"):
        assert len(doc["search"]["replay"][sampler]["0.95"]) == 3
    assert len(doc["spread"]["samples_per_s"]) == 3
    assert doc["overhead"]["fresh"]["start_s"] > 0
    (train,) = doc["training"]
    assert train["workload"] == "digits" and train["effective_batch_size"] == 64
    assert len(train["rounds"]) == 1 and train["samples_per_s"]["baseline"] > 0

    # The enumerated space is measured once per machine and software: the next run reuses it.
    again = run("-m", "benchmarks.run", "--suite", "cpu", "--smoke", "--parts", "2", "--out", str(tmp_path))
    assert "reusing the 4 measurements" in again.stdout
    assert json.loads((tmp_path / "cpu.json").read_text())["search"]["cached"]


def test_quick_compression_benchmark_prints_its_table(tmp_path):
    proc = run("-m", "benchmarks.compression", "--quick", "--out", str(tmp_path))
    assert "### lstm:" in proc.stdout
    assert "| setting " in proc.stdout and "| samples/s (x) |" in proc.stdout
    results = json.loads((tmp_path / "compression.json").read_text())
    rows = results["workloads"][0]["rows"]
    assert [r["setting"] for r in rows] == ["baseline", "structured 0.3", "int8_dynamic"]
    assert rows[0]["status"] == "ok"


def test_gpu_suite_stops_at_once_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the suite would run")
    with pytest.raises(SystemExit) as stop:
        benchmarks.run.main(["--suite", "gpu"])
    message = str(stop.value.code)  # what the interpreter prints to stderr, exiting with status 1
    assert "CUDA" in message and "\n" not in message


def test_gpu_models_have_the_real_shapes():
    n_resnet = sum(p.numel() for p in models.ResNet().parameters())
    n_vit = sum(p.numel() for p in models.ViT().parameters())
    assert n_resnet == 25_557_032  # torchvision's resnet50
    assert n_vit == 86_567_656  # torchvision's vit_b_16


def test_tiny_gpu_models_run_forward_on_the_cpu():
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        assert models.resnet50(width=8, layers=(1, 1, 1, 1))(x).shape == (2, models.N_CLASSES)
        assert models.vit_b16(image_size=32, dim=64, depth=2, heads=4)(x).shape == (2, models.N_CLASSES)


@pytest.mark.parametrize("cls", [models.FloatImages, models.Uint8Images])
def test_image_data_sets_give_normalized_float_samples_and_pickle_as_their_recipe(cls):
    data = cls(4, size=16, seed=3)
    image, label = data[1]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and label.dtype == torch.int64
    assert -3.0 < float(image.mean()) < 3.0
    blob = pickle.dumps(data)
    assert len(blob) < 1000  # the recipe, not the pixels
    assert torch.equal(pickle.loads(blob)[1][0], image)


def test_profile_cost_prints_the_ratio_and_the_profilers_seconds():
    from benchmarks import profile_cost

    pairs = [
        {"off": {"wall_s": 40.0}, "on": {"wall_s": 42.0, "profile_s": 1.6}, "ratio": 1.05},
        {"off": {"wall_s": 40.0}, "on": {"wall_s": 49.0, "profile_s": 1.8}, "ratio": 1.225},
    ]
    assert profile_cost.rows(pairs)[0] == [1, "40.0 s", "42.0 s", "1.050", "1.6 s (windows 1.6 s)"]
    # Profiling's own seconds decide (1.6 of 40.4 and 1.8 of 47.2), not the runs' walls, which
    # the search's own variance moves by more.
    assert profile_cost.verdict(pairs) == (
        "profiling's overhead: 1.7 s, +3.9% of the rest of the run (target <= 10%: met); the whole runs' wall "
        "times differ by +13.8% (median over pairs), mostly the search's own variance"
    )
    failed = [{"off": {"wall_s": 10.0}, "on": {"wall_s": 10.0, "profile_s": None, "error": "x"}, "ratio": 1.0}]
    assert profile_cost.rows(failed)[0][-1] == "not profiled: x"
    assert profile_cost.verdict(failed).startswith("profiling's overhead: not measured")


@pytest.mark.slow
def test_profile_cost_smoke_runs_both_ways_in_one_process(tmp_path):
    proc = run("-m", "benchmarks.profile_cost", "--smoke", "--out", str(tmp_path))
    assert "### A run's wall time with and without profiling (quickstart)" in proc.stdout
    assert "profiling's overhead: " in proc.stdout
    for label in ("on", "off"):
        assert (tmp_path / f"pair0-{label}" / "best_config.json").is_file()
    assert (tmp_path / "pair0-on" / "trace-baseline.json.gz").is_file()
    assert not (tmp_path / "pair0-off" / "trace-baseline.json.gz").exists()


def test_a_cached_table_replays_from_the_most_threads_measured(tmp_path):
    """A table measured over one and two threads replays with two as the baseline's (the user's
    stock setting), and the replay answers every configuration its space can propose."""
    from autotune.config import Config
    from benchmarks.replay import cached_table, configs_of, replay, space_of

    values = {"batch_size": [32, 64], "num_threads": [1, 2]}
    measured = space_of(values)
    results = {
        k: {"status": "ok", "samples_per_s": 100.0 * c["batch_size"] / 32 * c["num_threads"], "metric_drop": 0.0}
        for k, c in configs_of(measured).items()
    }
    path = tmp_path / "search-text.json"
    path.write_text(json.dumps({"fingerprint": {"space": {**measured.values, **values}}, "results": results}))
    space, table = cached_table(path)
    assert space.baseline["num_threads"] == 2 and Config(space.baseline).key() in table
    assert replay(space, table, "staged", 0, 4)[0.99] <= 4
