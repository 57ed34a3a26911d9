"""The benchmarks run end to end (their numbers are not checked: speed is never asserted), and the
GPU suite's models and data sets work at tiny sizes on the CPU."""

import ast
import dataclasses
import inspect
import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import benchmarks.run
from benchmarks import core, predict
from benchmarks.cpu import compression
from benchmarks.cpu import workloads as cpu_workloads
from benchmarks.gpu import bench as gpu
from benchmarks.gpu import check as gpu_check
from benchmarks.gpu import models
from benchmarks.gpu import timing as gpu_timing
from benchmarks.gpu import workloads as gpu_workloads
from tests.layout import find_cycle

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


# The layout (docs/benchmarks.md, "Layout"): one folder per workload family, the shared runner and
# helpers at the top, and no import circle among them.


def _import_graph() -> dict[str, set[str]]:
    """Every module of benchmarks/ and those of benchmarks/ it imports (at the top and inside
    functions, as the AST has them)."""
    root = ROOT / "benchmarks"
    modules = {
        ".".join(("benchmarks", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from this package, or one level up per extra dot
                    parent = package.split(".")[: package.count(".") + 2 - node.level]
                    base = ".".join([*parent, *([base] if base else [])])
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_no_import_circle_in_benchmarks():
    graph = _import_graph()
    assert {"benchmarks.run", "benchmarks.text.workload", "benchmarks.text.recipes"} <= set(graph)
    assert "benchmarks.text.workload" in graph["benchmarks.text.recipes"]  # the graph sees imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


# The workload contract (benchmarks/core.py): one Workload type and one registry, which each
# family's __init__.py fills and every benchmark reads.


def _runs_as_a_benchmark(name: str) -> bool:
    """Whether ``name`` (of a workload's ``benchmarks``) is one: ``run.<suite>`` or a module or
    folder run with ``python -m benchmarks.<name>``."""
    if name.startswith("run."):
        return name.removeprefix("run.") in benchmarks.run.SUITES
    path = ROOT / "benchmarks" / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def test_every_registered_workload_keeps_the_contract():
    from autotune.run.options import DEFAULT_MEASURE
    from autotune.trial.measure import MeasureSettings

    found = core.workloads()
    families = {init.parent.name for init in (ROOT / "benchmarks").glob("*/__init__.py")}
    assert {w.family for w in found} == families  # each family's folder registers its own
    for w in found:
        assert isinstance(w, core.Workload) and core.WORKLOADS[w.name] is w
        assert w.name and "," not in w.name and w.description and "\n" not in w.description
        assert w.modes and set(w.modes) <= set(core.MODES) and w.device in core.DEVICES
        assert all(isinstance(w.trials(mode), int) and w.trials(mode) >= 1 for mode in w.modes)
        options = inspect.signature(w.build).parameters.values()
        assert all(o.default is not o.empty for o in options), f"{w.name}: build() alone must build it"
        if w.measure is not None:
            MeasureSettings(**{**DEFAULT_MEASURE, **w.measure})  # the timing's own fields
        assert all(_runs_as_a_benchmark(b) for b in w.benchmarks), (w.name, w.benchmarks)
        assert isinstance(w.extras, dict)


def test_workload_names_are_unique_across_families():
    names = [w.name for w in core.workloads()]
    assert len(names) == len(set(names)) and {"digits", "resnet50-float", "text", "craft"} <= set(names)
    taken = core.workload("digits")
    twin = dataclasses.replace(taken, family="gpu", device="cuda", description="another model")
    with pytest.raises(ValueError, match=r"'digits' \(gpu\) is registered already \(cpu: "):
        core.register(twin)
    assert core.workload("digits") is taken
    with pytest.raises(ValueError, match="needs a trial budget for each of its modes"):
        dataclasses.replace(taken, name="digits-2", modes=("inference",), n_trials={"train": 2})


def test_an_unknown_workload_is_refused_in_one_line_that_names_the_known_ones():
    with pytest.raises(ValueError) as refused:
        core.workload("resnet51")
    message = str(refused.value)
    assert message.startswith("No workload named 'resnet51'. Known: ") and "\n" not in message
    assert all(w.name in message for w in core.workloads())
    with pytest.raises(ValueError, match="'digits-mlp' is tuned for train, not inference"):
        core.workload("digits-mlp").trials()


def test_a_workload_registered_in_a_test_is_found_where_the_benchmarks_look(request):
    built = {"model": torch.nn.Linear(4, 2), "dataset": [torch.randn(4) for _ in range(8)]}
    temporary = core.Workload(
        name="test-linear",
        family="cpu",
        description="a linear layer on 8 vectors",
        build=lambda: built,
        n_trials={"inference": 3, "train": 2},
        modes=("inference", "train"),
        benchmarks=("run.cpu", "claims", "cpu.compression"),
    )
    core.register(temporary)
    request.addfinalizer(lambda: core.WORKLOADS.pop(temporary.name))
    assert temporary in core.workloads(family="cpu", device="cpu", mode="train", benchmark="claims")
    assert temporary not in core.workloads(device="cuda") + core.workloads(benchmark="gpu")
    assert benchmarks.run.suite_workloads("cpu")[-1] == "test-linear"
    assert benchmarks.run.suite_workloads("cpu", "train")[-1] == "test-linear"
    assert compression.names()[-1] == "test-linear"
    assert predict.workload("test-linear", None) is temporary and benchmarks.run.build("test-linear") is built
    assert benchmarks.run.settings({}, "test-linear", "train") == {"n_trials": 2, "measure": None}


@pytest.mark.parametrize(
    ("benchmark", "names"),
    [
        ("claims", ["quickstart", "digits", "transformer"]),
        ("cpu.openvino", ["digits", "resnet"]),
        ("ddp", ["digits-mlp", "digits-cnn"]),
        ("gpu", ["resnet50-float", "resnet50-uint8", "bert-text"]),
        ("text.budget", ["text-padded", "hf"]),
        ("vision", ["craft"]),
        ("vision.photos", ["light", "resnet50"]),
    ],
)
def test_each_benchmark_runs_the_workloads_it_ran_before_the_registry(benchmark, names):
    assert [w.name for w in core.workloads(benchmark=benchmark)] == names


def test_the_suites_take_their_workloads_by_the_names_they_always_had_with_their_settings():
    assert benchmarks.run.suite_workloads("cpu") == ["digits", "transformer", "lstm"]
    assert benchmarks.run.suite_workloads("cpu", "train") == ["digits", "lstm"]
    gpu_compare = ["resnet50-memory", "resnet50-uint8", "vit_b16-memory", "vit_b16-uint8"]
    assert benchmarks.run.suite_workloads("gpu-compare") == gpu_compare
    assert benchmarks.run.suite_workloads("gpu-compare", "train") == ["resnet50-memory", "vit_b16-memory"]
    assert compression.names() == ["digits", "transformer", "lstm"]  # its transformer: the 2-layer one
    assert core.workload(compression.ALIASES["transformer"]).build is cpu_workloads.transformer
    settings, suites = benchmarks.run.settings, benchmarks.run.SUITES
    assert settings(suites["cpu"], "transformer") == {"n_trials": 10, "measure": core.CPU_MEASURE}
    assert settings(suites["cpu"], "lstm", "train") == {"n_trials": 16, "measure": core.CPU_MEASURE}
    assert settings({**suites["cpu"], "n_trials": 20}, "digits") == {"n_trials": 20, "measure": core.CPU_MEASURE}
    assert settings(suites["cpu-smoke"], "digits", "train") == {"n_trials": 2, "measure": benchmarks.run.QUICK_MEASURE}
    assert settings(suites["gpu-compare"], "resnet50-uint8") == {"n_trials": 8, "measure": None}
    assert settings(suites["gpu-compare"], "vit_b16-memory", "train") == {"n_trials": 6, "measure": None}


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


@pytest.mark.slow  # an end-to-end run: outside CI's time, run with -m slow
def test_quick_compression_benchmark_prints_its_table(tmp_path):
    proc = run("-m", "benchmarks.cpu.compression", "--quick", "--out", str(tmp_path))
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


# The GPU check (benchmarks/gpu/check.py): what it does without a GPU, on a small project of its own.

QUICK = """
import time
import pytest

pytestmark = pytest.mark.gpu

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3

def test_skips():
    pytest.skip("needs two GPUs")

def test_sleeps_past_its_limit():
    time.sleep(30)

def test_after_the_sleeper():
    pass
"""
HEAVY = """
import pathlib, signal, subprocess, sys, time
import pytest

@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_hangs_where_no_alarm_reaches():
    # A worker in a session of its own, as autotune starts its trial workers.
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    pathlib.Path("worker.pid").write_text(str(worker.pid))
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # as in a hung CUDA call: pytest-timeout's alarm never lands
    time.sleep(60)

@pytest.mark.gpu
def test_never_reached():
    pass

def test_runs_on_the_cpu():
    pass
"""
INI = "[pytest]\nmarkers =\n    gpu: needs CUDA\n    slow: slow\n"


def _project(tmp_path: Path) -> tuple[Path, Path]:
    project, out = tmp_path / "project", tmp_path / "logs"
    (out / "tests").mkdir(parents=True)
    project.mkdir()
    (project / "pytest.ini").write_text(INI)
    (project / "test_quick.py").write_text(QUICK)
    (project / "test_heavy.py").write_text(HEAVY)
    (project / "test_broken.py").write_text("import a_module_that_is_not_there\n")
    return project, out


def test_gpu_check_says_in_one_line_that_it_needs_cuda_and_starts_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the check would run")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.check", "--out", str(tmp_path / "logs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "needs a CUDA GPU" in line and proc.stdout == ""
    assert not (tmp_path / "logs").exists()
    assert time.monotonic() - started < 60


def test_gpu_check_collects_the_gpu_tests_by_file_cheapest_first(tmp_path):
    project, out = _project(tmp_path)
    files, errors = gpu_check.collect(out, ("test_quick.py", "test_heavy.py", "test_broken.py"), cwd=project)
    assert sorted(files) == ["test_heavy.py", "test_quick.py"]
    assert len(files["test_quick.py"]) == 5
    heavy = {t["nodeid"]: t for t in files["test_heavy.py"]}  # the CPU test is left out
    assert set(heavy) == {"test_heavy.py::test_hangs_where_no_alarm_reaches", "test_heavy.py::test_never_reached"}
    assert heavy["test_heavy.py::test_hangs_where_no_alarm_reaches"] == {
        "nodeid": "test_heavy.py::test_hangs_where_no_alarm_reaches",
        "slow": True,
        "timeout_s": 90,
    }
    (error,) = errors
    assert error["nodeid"] == "test_broken.py" and "a_module_that_is_not_there" in error["message"]
    # A slow test weighs as five: two tests, one slow, after five quick ones.
    assert gpu_check.order(files) == ["test_quick.py", "test_heavy.py"]
    assert json.loads((out / "collected.json").read_text()) == {"files": files, "errors": errors}
    # A file's limit is twice its share by weight of the time left, 30 s at least, what is left at most.
    assert gpu_check.file_share(260, 1, 52) == 30 and gpu_check.file_share(260, 13, 52) == 130
    assert gpu_check.file_share(100, 13, 13) == 100 and gpu_check.file_share(20, 1, 1) == 20
    # Each test may take twice its even share of the file's time, a minute at least, the file's time at most.
    assert gpu_check.file_limits(300, 3) == (300, 200)
    assert gpu_check.file_limits(100, 10) == (100, 60)
    assert gpu_check.file_limits(40, 1) == (40, 40)


def test_gpu_check_records_each_tests_outcome_with_a_limit_per_test(tmp_path):
    pytest.importorskip("pytest_timeout")
    project, out = _project(tmp_path)
    files, _ = gpu_check.collect(out, ("test_quick.py",), cwd=project)
    rec = gpu_check.run_file("test_quick.py", files["test_quick.py"], 60, out, cwd=project, per_test_s=2)
    got = {t["nodeid"].split("::")[1]: (t["outcome"], t["message"]) for t in rec["tests"]}
    assert got == {
        "test_passes": ("passed", ""),
        "test_fails": ("failed", "assert (1 + 1) == 3"),
        "test_skips": ("skipped", "Skipped: needs two GPUs"),
        "test_sleeps_past_its_limit": ("timed_out", "Failed: Timeout (>2.0s) from pytest-timeout."),
        "test_after_the_sleeper": ("passed", ""),  # a timed-out test costs only itself
    }
    assert rec["counts"] == {"passed": 2, "failed": 1, "skipped": 1, "timed_out": 1, "not_run": 0}
    assert not rec["killed"] and rec["wall_s"] < 30
    assert "test_after_the_sleeper PASSED" in (out / "tests" / "test_quick.log").read_text()


def test_a_file_past_its_limit_is_killed_with_the_workers_it_started(tmp_path):
    project, out = _project(tmp_path)
    files, _ = gpu_check.collect(out, ("test_heavy.py",), cwd=project)
    rec = gpu_check.run_file("test_heavy.py", files["test_heavy.py"], 6, out, cwd=project)
    assert rec["killed"] and rec["wall_s"] < 20
    got = {t["nodeid"].split("::")[1]: t["outcome"] for t in rec["tests"]}
    assert got == {"test_hangs_where_no_alarm_reaches": "timed_out", "test_never_reached": "not_run"}
    worker = int((project / "worker.pid").read_text())
    deadline = time.monotonic() + 10
    try:
        while psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the test's worker outlived the kill"
            time.sleep(0.1)
    finally:
        if psutil.pid_exists(worker):  # this test's own sleeper, should the check have missed it
            psutil.Process(worker).kill()


def test_gpu_check_summary_counts_each_file_and_fails_on_a_failed_test(tmp_path, monkeypatch):
    project, out = _project(tmp_path)
    (project / "test_quick.py").write_text(QUICK.replace("time.sleep(30)", "pass"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check's only CUDA question
    argv = ["--out", str(out), "--budget-s", "120", "--no-bench", str(project / "test_quick.py")]
    assert gpu_check.main(argv) == 1
    (rec,) = json.loads((out / "summary.json").read_text())["files"]
    assert rec["counts"] == {"passed": 3, "failed": 1, "skipped": 1, "timed_out": 0, "not_run": 0}
    summary = (out / "summary.md").read_text()
    assert "| 5 | 3 | 1 | 1 | 0 | 0 |" in summary and "test_fails`: assert (1 + 1) == 3" in summary
    assert "benchmark: not run (--no-bench)" in summary
    assert "1 failed" in (out / "check.log").read_text()


def test_gpu_check_reruns_only_what_an_earlier_check_left_unfinished(tmp_path, monkeypatch):
    project, out = _project(tmp_path)
    (project / "test_quick.py").write_text(QUICK.replace("time.sleep(30)", "pass"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--budget-s", "120", "--no-bench", str(project / "test_quick.py")]
    assert gpu_check.main(["--out", str(out), *argv]) == 1
    again = tmp_path / "again"
    assert gpu_check.main(["--out", str(again), "--rerun", str(out / "summary.json"), *argv]) == 1
    (rec,) = json.loads((again / "summary.json").read_text())["files"]
    assert [(t["nodeid"].split("::")[-1], t["outcome"]) for t in rec["tests"]] == [("test_fails", "failed")]
    assert gpu_check.main(["--out", str(again), "--rerun", str(project / "test_quick.py"), *argv]) == 2


def _marks_gpu(path: Path) -> bool:
    """Whether the module's code (not a string in it) names ``pytest.mark.gpu``."""
    import ast

    return any(
        isinstance(node, ast.Attribute) and node.attr == "gpu" and ast.unparse(node.value) == "pytest.mark"
        for node in ast.walk(ast.parse(path.read_text()))
    )


@pytest.mark.slow
def test_gpu_check_collects_every_file_that_marks_a_gpu_test(tmp_path):
    files, errors = gpu_check.collect(tmp_path)
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if _marks_gpu(p)}
    assert set(files) == marked and not errors
    assert all(t["nodeid"].startswith(f + "::") for f, tests in files.items() for t in tests)


# The GPU headline benchmark (benchmarks/gpu/bench.py): what runs without a GPU.


@pytest.mark.parametrize("argv", [["--suite", "gpu-compare"], ["--suite", "gpu", "--workloads", "bert-text"]])
def test_gpu_suites_stop_at_once_without_cuda(argv):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the suite would run")
    with pytest.raises(SystemExit) as stop:
        benchmarks.run.main(argv)
    message = str(stop.value.code)
    assert "CUDA" in message and "\n" not in message


def test_gpu_benchmark_says_in_one_line_that_it_needs_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the benchmark would run")
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--out", str(tmp_path / "bench")])
    assert str(stop.value.code) == (
        f"The GPU benchmark needs a CUDA GPU, and torch {torch.__version__} sees none here."
    )
    assert not (tmp_path / "bench").exists()
    with pytest.raises(SystemExit):  # an unknown workload is refused by name, with the known ones
        gpu.main(["--workloads", "resnet50-float,vit"])


def test_gpu_benchmark_models_have_bert_base_and_resnet50_shapes():
    assert sum(p.numel() for p in gpu_workloads.Bert().parameters()) == 109_482_240  # transformers' BertModel
    assert sum(p.numel() for p in gpu_workloads.resnet50_uint8().parameters()) == 25_557_032  # torchvision's resnet50


def test_tiny_bert_embeds_padded_sentences_as_it_does_trimmed_ones():
    text = gpu_workloads.TokenSequences(8, seed=1)
    batch = gpu_workloads.pad_to_max([text[i] for i in range(8)])  # (8, 128) each
    longest = int(batch["attention_mask"].sum(1).max())
    model = gpu_workloads.bert_base(dim=64, depth=2, heads=4)
    with torch.inference_mode():
        padded = model(**batch)
        trimmed = model(**{k: v[:, :longest] for k, v in batch.items()})
    assert padded.shape == (8, 64) and longest < gpu_workloads.MAX_LEN
    torch.testing.assert_close(padded, trimmed)  # the mask keeps padding out of every real token's attention


def test_gpu_benchmark_data_sets_pickle_as_their_recipe():
    text = gpu_workloads.TokenSequences(1024)
    lengths = torch.tensor([len(text[i]["input_ids"]) for i in range(len(text))])
    assert lengths.min() >= 16 and lengths.max() <= gpu_workloads.MAX_LEN and 30 <= lengths.median() <= 50
    for data in (text, gpu_workloads.FloatImageTensors(4, size=16), gpu_workloads.Uint8ImageTensors(4, size=16)):
        blob = pickle.dumps(data)
        assert len(blob) < 1000  # the recipe, not the samples
        again, first = pickle.loads(blob)[3], data[3]
        assert all(torch.equal(again[k], first[k]) for k in (first if isinstance(first, dict) else range(2)))
    images, label = gpu_workloads.Uint8ImageTensors(4, size=16)[0]
    assert images.dtype == torch.uint8 and images.shape == (3, 16, 16) and label.dtype == torch.int64
    normalized = gpu_workloads.Uint8Input()(images[None])
    torch.testing.assert_close(normalized[0], (images.float() / 255 - models.MEAN) / models.STD)


def test_gpu_benchmark_rows_time_whole_epochs_under_their_own_settings():
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(96, 3, 8, 8), torch.zeros(96, dtype=torch.long))
    cpu, stock = torch.device("cpu"), gpu_timing.Flags.read()
    seen = []
    model = torch.nn.Conv2d(3, 4, 3)
    model.register_forward_hook(
        lambda m, i, o: seen.append((o.dtype, i[0].is_contiguous(), torch.backends.cudnn.benchmark))
    )
    flags = dataclasses.replace(stock, cudnn_benchmark=not stock.cudnn_benchmark)
    row = gpu_timing.Row(
        "expert", model, DataLoader(data, batch_size=32), flags, 32, "", torch.bfloat16, channels_last=True
    )
    with torch.inference_mode():
        # No minimum time: two whole epochs of three batches, however fast the machine.
        assert gpu_timing.time_epochs(row, cpu, stock, min_s=0.0) > 0
        assert len(seen) == 6
        assert gpu_timing.model_alone(row, cpu, stock, len(data), min_s=0.01) > 0
    assert set(seen) == {(torch.bfloat16, False, flags.cudnn_benchmark)}  # autocast, channels-last, the row's flags
    assert gpu_timing.Flags.read() == stock  # given back after the row


def test_the_gpu_benchmarks_resident_recipe_slices_batches_on_the_device_and_rows_rotate():
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(600, 3, 8, 8), torch.zeros(600, dtype=torch.long))
    cpu, stock = torch.device("cpu"), gpu_timing.Flags.read()
    spec = {"model": lambda: torch.nn.Conv2d(3, 4, 3), "collate": None}
    row = gpu.resident_row(spec, data, cpu, stock, compiled=False)
    batches = list(row.loader)
    assert [len(b[0]) for b in batches] == [256, 256, 88] and len(row.loader) == 3
    assert torch.equal(torch.cat([b[0] for b in batches]), data.tensors[0])
    with torch.inference_mode():
        assert gpu_timing.time_epochs(row, cpu, stock, min_s=0.0) > 0
    record = gpu._row_record(dataclasses.replace(row, rates=[50.0]), 25.0, 100.0)
    assert record["x_baseline"] == 2.0 and record["of_alone"] == 0.5
    doc = {"workload": "w", "unit": "images/s", "rows": [record], "claimed_speedup": None, "n_trials": 0,
           "search_s": 0.0, "wall_s": 0.0}  # fmt: skip
    assert "| w | resident | 50 images/s | 2.00x | 50% | 256 |" in gpu.table_text([doc])
    assert [gpu.rotated([1, 2, 3], i)[0] for i in range(4)] == [1, 2, 3, 1]


def test_the_claims_benchmark_rates_each_path_apart_against_its_own_processs_plain_loop():
    """``--apart``: a user's process holds one path. Each path's ratio is to the plain loop timed
    in its own process (whose speed is that process's), never to another process's."""
    claim = {"speedup": 3.0}
    results = [
        {"rates": {"plain": [50.0, 50.0], "apply+dataloader": [150.0, 150.0]}, "first_predict_s": float("nan"),
         "build_s": float("nan"), "compile_s": float("nan"), "n_compiles": 0, "claim": claim, "served": None},
        {"rates": {"plain": [100.0, 100.0], "predict": [250.0, 250.0]}, "first_predict_s": 2.5,
         "build_s": float("nan"), "compile_s": float("nan"), "n_compiles": 0, "claim": claim, "served": None},
    ]  # fmt: skip
    merged = predict.apart(results)
    assert merged["ratios"] == pytest.approx({"plain": 1.0, "apply+dataloader": 3.0, "predict": 2.5})
    assert merged["first_predict_s"] == 2.5 and merged["rates"]["plain"] == [50.0, 50.0, 100.0, 100.0]
    row = predict.report("cfg", [merged])
    # A column per path, each to its own process's plain loop; "-" for a path not timed.
    assert row[3:7] == ["3.00x", "-", "2.50x", "-"], row
    assert predict.sides([{**merged, "claim": {**claim, "rounds": []}}]).startswith("the claim's rounds: not kept")
