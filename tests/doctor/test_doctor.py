"""autotune doctor: real checks of this machine, and the rules on recorded facts of others."""

import copy
import json
import subprocess
import sys

import pytest

import autotune.doctor.core as _doctor
from autotune.cli import _print_checks, main
from autotune.doctor.core import Check, diagnose, gather
from autotune.doctor.probe import compile_probe
from autotune.runtimes.onnxruntime import ort_provider_loads

# What gather() recorded on a GPU server: one H100 with another job's memory on it, a torch
# built for CUDA 12.4 under a driver for 12.2, and an onnxruntime-gpu whose CUDA provider
# cannot find its libraries.
RECORDED_GPU = {
    "packages": {"triton": "3.1.0"},
    "driver": {"version": "535.161.08", "cuda": "12.2", "n_gpus": 1},
    "torch": {
        "version": "2.5.1+cu124",
        "cuda_build": "12.4",
        "hip_build": None,
        "cudnn": 90100,
        "arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
        "cuda_available": True,
        "device_count": 1,
        "cuda_visible_devices": None,
        "dynamo_supported": True,
    },
    "gpus": [
        {
            "index": 0,
            "name": "NVIDIA H100 80GB HBM3",
            "capability": [9, 0],
            "memory_bytes": 85045346304,
            "free_bytes": 64424509440,
            "multiprocessors": 132,
            "bf16": True,
            "fp16": True,
            "triton": True,
        }
    ],
    "onnxruntime": {
        "version": "1.20.1",
        "providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
        "loads": {
            "CUDAExecutionProvider": {"ok": False, "detail": "libcudnn.so.9: cannot open shared object file"},
            "TensorrtExecutionProvider": {"ok": True, "detail": "a session ran on it"},
        },
    },
}


@pytest.fixture(scope="module")
def facts():
    """This machine's facts, gathered once for the tests that only read them."""
    return gather(".")


def _with(facts, **parts):
    """A copy of ``facts`` with whole parts replaced and nested dicts updated."""
    out = copy.deepcopy(facts)
    for key, value in parts.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key].update(copy.deepcopy(value))
        else:
            out[key] = copy.deepcopy(value)
    return out


def _row(checks, name):
    found = [c for c in checks if c.name == name]
    assert found, f"no check named {name!r} in {[c.name for c in checks]}"
    return found[0]


def _render(checks):
    from rich.console import Console

    console = Console(record=True, width=250, color_system=None)
    _print_checks(console, checks)
    return console.export_text()


def test_importing_the_doctor_and_the_cli_imports_no_torch():
    code = (
        "import sys, autotune.cli, autotune.doctor.core, autotune.doctor.checks, autotune.doctor.host, "
        "autotune.doctor.probe; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_this_machine(facts):
    import torch

    checks = diagnose(facts)
    json.dumps([c.to_dict() for c in checks])
    json.dumps(facts)  # the --json output carries the facts too
    assert all(c.status in _doctor.STATUSES and c.section in _doctor.SECTIONS for c in checks)
    order = [_doctor.SECTIONS.index(c.section) for c in checks]
    assert order == sorted(order)
    assert torch.__version__ in _row(checks, "torch").detail
    assert _row(checks, "optuna").status == "ok" and _row(checks, "onnx").status == "ok"
    assert facts["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["cpu"]["torch_threads"] == torch.get_num_threads()
    assert "logical cores" in _row(checks, "cpu").detail
    assert _row(checks, "disk").status in ("ok", "warn", "fail")
    for c in checks:  # a problem always says what to do
        assert c.status not in ("warn", "fail") or c.fix


def test_without_a_compiler_on_path_the_problem_comes_with_its_fix(monkeypatch, tmp_path):
    import autotune.doctor.probe as probe

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no g++, c++ or cc
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    compiled = []  # devices the tiny compile was attempted on (GPUs only run it, without a C compiler)
    monkeypatch.setattr(probe, "compile_probe", lambda device, timeout: compiled.append(device) or {"ok": True})
    facts = gather(tmp_path, compile_check=True)
    checks = diagnose(facts)
    row = _row(checks, "C++ compiler")
    assert row.status == "warn" and "no C++ compiler" in row.detail and "cannot run on CPU" in row.detail
    assert "apt install g++" in row.fix and "compile_mode" in row.fix
    # The tiny compile is not attempted on the CPU: its failure is already known and explained.
    assert "cpu" not in compiled and _row(checks, "compile check (cpu)").status == "info"
    monkeypatch.undo()
    assert _row(diagnose(gather(tmp_path)), "C++ compiler").status == "ok"


@pytest.mark.slow
def test_compile_check_compiles_a_tiny_function():
    result = compile_probe("cpu", timeout=300)
    assert result["ok"], result["error"]
    assert result["seconds"] > 0


def test_cli_json_gives_checks_facts_and_the_exit_code(capsys):
    code = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    checks = [Check(**c) for c in report["checks"]]
    assert code == _doctor.exit_code(checks)
    assert report["facts"]["torch"]["version"]


def test_cli_exits_1_when_a_check_fails(facts, monkeypatch, capsys):
    full = _with(facts, system={"disk": {"path": "/srv/results", "free_bytes": 100 * 2**20, "total_bytes": 2**40}})
    monkeypatch.setattr(_doctor, "gather", lambda *a, **k: full)
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "fail" in out and "another --out directory" in out


def test_gpu_section_from_a_recorded_gpu_server(facts):
    recorded = _with(facts, **RECORDED_GPU)
    checks = diagnose(recorded)
    gpu = _row(checks, "gpu 0")
    assert gpu.status == "warn" and "in use by other processes" in gpu.detail  # 19 GiB of another job
    assert _row(checks, "gpu 0 bf16/fp16").status == "ok"
    assert _row(checks, "CUDA build vs driver").status == "warn"  # 12.4 on a 12.2 driver: minor-version compat
    assert _row(checks, "cuDNN").detail.startswith("9.1.0")
    assert _row(checks, "Triton").status == "ok"
    cuda_ep = _row(checks, "CUDAExecutionProvider")
    assert cuda_ep.status == "warn" and "libcudnn.so.9" in cuda_ep.detail and "ort_provider" in cuda_ep.fix
    assert _row(checks, "TensorrtExecutionProvider").status == "ok"
    text = _render(checks)
    for expected in ("gpu 0", "NVIDIA H100 80GB HBM3", "79.2 GiB", "compute capability 9.0 (sm90)", "132 SMs"):
        assert expected in text


def test_an_old_gpu_and_an_old_driver(facts):
    t4 = dict(RECORDED_GPU["gpus"][0], name="Tesla T4", capability=[7, 5], bf16=False, free_bytes=None)
    recorded = _with(
        facts, **{**RECORDED_GPU, "gpus": [t4], "driver": {"version": "470.57", "cuda": "11.4", "n_gpus": 1}}
    )
    checks = diagnose(recorded)
    driver = _row(checks, "CUDA build vs driver")
    assert driver.status == "fail" and "cu114" in driver.fix
    precision = _row(checks, "gpu 0 bf16/fp16")
    assert precision.status == "info" and "8.0+" in precision.detail
    assert _doctor.exit_code(checks) == 1


def test_a_gpu_newer_than_the_torch_build(facts):
    blackwell = dict(RECORDED_GPU["gpus"][0], name="NVIDIA B200", capability=[10, 0])
    checks = diagnose(_with(facts, **{**RECORDED_GPU, "gpus": [blackwell]}))
    row = _row(checks, "gpu 0 kernels")
    assert row.status == "fail" and "sm100" in row.detail


def test_cpu_only_torch_on_a_gpu_machine(facts):
    recorded = _with(facts, driver={"version": "550.54.15", "cuda": "12.4", "n_gpus": 2})
    recorded["torch"].update(cuda_build=None, cuda_available=False)
    row = _row(diagnose(recorded), "torch build")
    assert row.status == "warn" and "CPU-only" in row.detail and "12.4" in row.fix


def test_container_limits(facts):
    recorded = _with(
        facts,
        cpu={"quota_cores": 2.0, "usable_cores": 16, "torch_threads": 16},
        system={"shm": {"path": "/dev/shm", "free_bytes": 64 * 2**20, "total_bytes": 64 * 2**20}},
    )
    checks = diagnose(recorded)
    threads = _row(checks, "threads")
    assert threads.status == "warn" and "OMP_NUM_THREADS=2" in threads.fix
    shm = _row(checks, "shared memory")
    assert shm.status == "warn" and "bus error" in shm.detail and "--shm-size" in shm.fix


def test_arch_list_rules():
    from autotune.doctor.checks import _arch_supported

    assert _arch_supported((8, 6), ["sm_80"])  # same major, later minor: binary compatible
    assert not _arch_supported((9, 0), ["sm_80", "sm_86"])
    assert _arch_supported((9, 0), ["sm_80", "compute_80"])  # PTX is compiled by the driver
    assert _arch_supported((9, 0), ["sm_90a"])


def test_a_listed_provider_that_cannot_load_says_why():
    import onnxruntime
    import torch

    if torch.cuda.is_available() or "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("needs onnxruntime-gpu on a machine without CUDA")
    result = ort_provider_loads("CUDAExecutionProvider")
    assert not result["ok"] and result["detail"] and result["detail"] != "no reason logged"


@pytest.mark.gpu
def test_gpu_section_is_printed_when_cuda_is_present(capsys, monkeypatch):
    import torch

    monkeypatch.setenv("COLUMNS", "250")
    main(["doctor"])
    out = capsys.readouterr().out
    assert "gpu 0" in out and torch.cuda.get_device_name(0) in out
    assert "CUDA build vs driver" in out and "cuDNN" in out
