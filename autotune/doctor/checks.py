"""The doctor's rules for the torch stack: software, CUDA, GPUs and torch.compile.

Facts (from :func:`autotune.doctor.core.gather`) in, :class:`Check` rows out; the CPU and
system rules are in :mod:`autotune.doctor.host`, each runtime's in its own module
(:meth:`autotune.runtimes.base.Runtime.doctor_checks`).

Pure functions of the facts dict, one per section, so that a report recorded on another
machine (a GPU server, say) is diagnosed and printed the same way here. Each problem carries
what to do about it.
"""

from __future__ import annotations

from typing import Any

from autotune.doctor.base import _ESSENTIAL, _GIB, _NO_COMPILE, Check, _gib, _gpu_list

__all__ = ["compiler", "cuda", "gpus", "software"]


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = []
    for piece in str(text).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


# --- software ----------------------------------------------------------------------------------


def software(facts: dict[str, Any]) -> list[Check]:
    """Python, torch, optuna and onnx, and autotune's install requirements."""
    py = facts["python"]
    rows = [Check("software", "python", "ok", f"{py['version']} ({py['implementation']})")]
    torch = facts["torch"]
    if "error" in torch:
        rows.append(
            Check(
                "software",
                "torch",
                "fail",
                f"cannot import torch: {torch['error']}",
                "install torch: pip install torch (on a GPU machine, the CUDA build for your driver: "
                "see pytorch.org/get-started)",
            )
        )
    else:
        build = f"built for CUDA {torch['cuda_build']}" if torch["cuda_build"] else "a CPU-only build"
        if torch.get("hip_build"):
            build = f"built for ROCm {torch['hip_build']}"
        rows.append(Check("software", "torch", "ok", f"{torch['version']}, {build}"))
    requirements = {r["name"]: r for r in facts.get("requirements") or []}
    for name, role in (("optuna", "runs the search"), ("onnx", "writes and checks the ONNX artifact")):
        version = facts["packages"].get(name)
        req = requirements.get(name)
        if req is not None and not req["ok"]:
            continue  # reported with the requirements below
        if version is None:
            status = "fail" if name in _ESSENTIAL else "warn"
            rows.append(Check("software", name, status, f"not installed ({role})", f"pip install {name}"))
        else:
            rows.append(Check("software", name, "ok", f"{version} ({role})"))
    return rows + _requirement_rows(facts.get("requirements"))


def _requirement_rows(requirements: list[dict[str, Any]] | None) -> list[Check]:
    if requirements is None:
        return [
            Check(
                "software",
                "requirements",
                "info",
                "autotune's package metadata was not found (run from a source tree?): its requirements "
                "were not compared with what is installed",
                "pip install -e . in the source tree installs them",
            )
        ]
    unmet = [r for r in requirements if not r["ok"]]
    if not unmet:
        return [Check("software", "requirements", "ok", f"all {len(requirements)} install requirements are met")]
    rows = []
    for req in unmet:
        have = f"{req['installed']} is installed" if req["installed"] else "it is not installed"
        status = "fail" if req["name"] in _ESSENTIAL else "warn"
        rows.append(
            Check(
                "software",
                req["name"],
                status,
                f"autotune needs {req['requirement']}, but {have}",
                f"pip install '{req['requirement']}'",
            )
        )
    return rows


# --- CUDA: torch's build against the driver ----------------------------------------------------


def cuda(facts: dict[str, Any]) -> list[Check]:
    """torch's CUDA build against the driver, the devices torch sees, and cuDNN."""
    torch, driver = facts["torch"], facts["driver"]
    if "error" in torch:
        return []
    if not torch["cuda_build"]:
        return [_cpu_only_torch(torch, driver)]
    rows = [_build_vs_driver(torch, driver)]
    n_seen = driver.get("n_gpus") or 0
    if not torch["cuda_available"] and (n_seen or driver.get("cuda")):
        rows.append(
            Check(
                "cuda",
                "CUDA available",
                "fail",
                f"the driver manages {n_seen or 'some'} GPU(s), but torch.cuda.is_available() is False",
                "check the row above (driver too old?), that CUDA_VISIBLE_DEVICES names existing GPUs, and that "
                "this process may open /dev/nvidia* (containers: --gpus all)",
            )
        )
    if torch.get("cuda_visible_devices") is not None:
        visible = f"set to {torch['cuda_visible_devices']!r}: torch sees {torch['device_count']} device(s)"
        rows.append(Check("cuda", "CUDA_VISIBLE_DEVICES", "info", visible))
    if torch["cuda_available"]:
        rows.append(_cudnn(torch))
    return rows


def _cpu_only_torch(torch: dict[str, Any], driver: dict[str, Any]) -> Check:
    n_seen = driver.get("n_gpus") or 0
    if not n_seen:
        return Check("cuda", "torch build", "info", "CPU-only torch and no NVIDIA driver: trials run on the CPU")
    return Check(
        "cuda",
        "torch build",
        "warn",
        f"this machine has {n_seen} NVIDIA GPU(s) (driver {driver.get('version') or '?'}), but torch "
        f"{torch['version']} is a CPU-only build: every trial runs on the CPU",
        "install the CUDA build of torch for a CUDA version the driver supports "
        f"(up to {driver.get('cuda') or 'what nvidia-smi shows'}): see pytorch.org/get-started",
    )


def _build_vs_driver(torch: dict[str, Any], driver: dict[str, Any]) -> Check:
    build, supported = torch["cuda_build"], driver.get("cuda")
    name = "CUDA build vs driver"
    if supported is None:
        if torch["cuda_available"]:
            return Check(
                "cuda", name, "ok", f"torch built for CUDA {build}; CUDA works (the driver's version was not readable)"
            )
        return Check(
            "cuda",
            name,
            "info",
            f"torch is built for CUDA {build}, but no NVIDIA driver is loaded: trials run on the CPU",
        )
    have, need = _version_tuple(supported), _version_tuple(build)
    detail = f"torch built for CUDA {build}; driver {driver.get('version') or '?'} supports CUDA up to {supported}"
    wheel = f"cu{supported.replace('.', '')}"
    if have is None or need is None or have >= need:
        return Check("cuda", name, "ok", detail)
    if have[0] < need[0]:
        return Check(
            "cuda",
            name,
            "fail",
            f"{detail}: the driver is too old for this torch, CUDA cannot start",
            f"upgrade the NVIDIA driver to one that supports CUDA {build}, or install a torch built for CUDA "
            f"{supported} or older (e.g. pip install torch --index-url https://download.pytorch.org/whl/{wheel})",
        )
    return Check(
        "cuda",
        name,
        "warn",
        f"{detail}: runs through CUDA minor-version compatibility, but kernels compiled at run time "
        "(Triton, PTX) can fail",
        f"upgrade the NVIDIA driver to one that supports CUDA {build}, or install a torch built for CUDA {supported}",
    )


def _cudnn(torch: dict[str, Any]) -> Check:
    version = torch.get("cudnn")
    if not version:
        return Check(
            "cuda",
            "cuDNN",
            "warn",
            "torch finds no cuDNN: convolutions run on slower kernels and cudnn_benchmark has no effect",
            "install the CUDA build of torch from pytorch.org, which ships cuDNN (or pip install nvidia-cudnn-cu12)",
        )
    # cuDNN 9 encodes 9.1.0 as 90100; cuDNN 8 encoded 8.9.2 as 8902.
    major, rest = (version // 10000, version % 10000) if version >= 10000 else (version // 1000, version % 1000)
    return Check("cuda", "cuDNN", "ok", f"{major}.{rest // 100}.{rest % 100}; cudnn_benchmark is a knob")


# --- GPUs --------------------------------------------------------------------------------------


def _arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a build for ``arch_list`` (``sm_80``, ``compute_90``...) has kernels for a GPU."""
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        number = number.rstrip("af")  # sm_90a, sm_100f: family- or arch-specific variants
        if not number.isdigit() or len(number) < 2:
            continue
        version = (int(number[:-1]), int(number[-1]))
        if kind == "sm" and version[0] == capability[0] and version[1] <= capability[1]:
            return True  # binaries run on later minor versions of the same major
        if kind == "compute" and version <= capability:
            return True  # PTX is compiled for newer GPUs by the driver
    return False


def gpus(facts: dict[str, Any]) -> list[Check]:
    """One row per GPU (name, memory, compute capability), its precisions, and whether torch's
    build has kernels for it."""
    raw = facts.get("gpus")
    if isinstance(raw, dict) and "error" in raw:
        return [
            Check(
                "gpu",
                "gpus",
                "fail",
                f"torch sees CUDA but cannot read the GPUs: {raw['error']}",
                "run nvidia-smi: a GPU in a bad state (Xid errors) needs a reset or a reboot",
            )
        ]
    arch_list = facts["torch"].get("arch_list") or []
    rows = []
    for gpu in _gpu_list(facts):
        rows += _one_gpu(gpu, arch_list)
    return rows


def _one_gpu(gpu: dict[str, Any], arch_list: list[str]) -> list[Check]:
    label = f"gpu {gpu['index']}"
    major, minor = gpu["capability"]
    total, free = gpu["memory_bytes"], gpu.get("free_bytes")
    detail = f"{gpu['name']}, {_gib(total)}"
    detail += f" ({_gib(free)} free)" if free is not None else ""
    detail += f", compute capability {major}.{minor} (sm{major}{minor}), {gpu.get('multiprocessors', '?')} SMs"
    rows = [Check("gpu", label, "ok", detail)]
    used = total - free if free is not None else 0
    if used > max(0.1 * total, _GIB):
        rows[0] = Check(
            "gpu",
            label,
            "warn",
            f"{detail}; {_gib(used)} is in use by other processes: large batches run out of memory sooner and timings are noisy",
            f"tune on an idle GPU (CUDA_VISIBLE_DEVICES selects one, nvidia-smi shows who uses {label})",
        )
    if arch_list and not _arch_supported((major, minor), arch_list):
        rows.append(
            Check(
                "gpu",
                f"{label} kernels",
                "fail",
                f"this torch has kernels for {', '.join(arch_list)}, none of which runs on sm{major}{minor}",
                f"install a torch build that supports compute capability {major}.{minor} (a newer release "
                "or CUDA version: see pytorch.org/get-started)",
            )
        )
    rows.append(_gpu_precision(label, gpu, (major, minor)))
    return rows


def _gpu_precision(label: str, gpu: dict[str, Any], capability: tuple[int, int]) -> Check:
    cap = f"{capability[0]}.{capability[1]}"
    if gpu.get("bf16") and capability >= (8, 0):
        return Check(
            "gpu",
            f"{label} bf16/fp16",
            "ok",
            "bfloat16 and float16 autocast run on tensor cores; TF32 and 2:4 sparsity are offered too",
        )
    if capability >= (7, 0):
        return Check(
            "gpu",
            f"{label} bf16/fp16",
            "info",
            f"float16 autocast runs on tensor cores; bfloat16, TF32 and 2:4 sparsity need compute capability 8.0+ "
            f"(this GPU has {cap}), so they are left out",
        )
    return Check(
        "gpu",
        f"{label} bf16/fp16",
        "info",
        f"float16 autocast is offered but this GPU (compute capability {cap}) has no tensor cores, so it rarely "
        "pays off; no bfloat16 or TF32",
    )


# --- torch.compile -----------------------------------------------------------------------------


def compiler(facts: dict[str, Any]) -> list[Check]:
    """What torch.compile needs here: dynamo on this Python, a C++ compiler (CPU), Triton and a C
    compiler (CUDA), and the optional tiny real compile."""
    torch = facts["torch"]
    if "error" in torch:
        return []
    rows = []
    if not torch.get("dynamo_supported", True):
        rows.append(
            Check(
                "compile",
                "torch.compile",
                "warn",
                f"torch {torch['version']} does not support torch.compile on Python {facts['python']['version']}",
                f"use a Python version this torch supports for torch.compile, {_NO_COMPILE}",
            )
        )
    cxx = facts["compilers"].get("cxx")
    if cxx:
        rows.append(Check("compile", "C++ compiler", "ok", f"{cxx}: torch.compile can build CPU kernels"))
    else:
        rows.append(
            Check(
                "compile",
                "C++ compiler",
                "warn",
                "no C++ compiler: torch.compile cannot run on CPU, so compile_mode is left out of CPU searches",
                f"install g++ (apt install g++, or set CXX to a C++ compiler), {_NO_COMPILE}",
            )
        )
    if _gpu_list(facts):
        rows.append(_triton(facts))
    return rows + _compile_checks(facts)


def _triton(facts: dict[str, Any]) -> Check:
    version, cc = facts["packages"].get("triton"), facts["compilers"].get("cc")
    old = [g for g in _gpu_list(facts) if tuple(g["capability"]) < (7, 0)]
    if version is None:
        return Check(
            "compile",
            "Triton",
            "warn",
            "not installed: torch.compile cannot generate CUDA kernels, so compile_mode is left out on GPU",
            f"pip install triton (the version your torch release pins), {_NO_COMPILE}",
        )
    if cc is None:
        return Check(
            "compile",
            "Triton",
            "warn",
            f"triton {version} is installed, but there is no C compiler: Triton builds a launcher with one at its first compile",
            f"install gcc (apt install gcc, or set CC to a C compiler), {_NO_COMPILE}",
        )
    if old:
        names = ", ".join(f"gpu {g['index']}" for g in old)
        return Check(
            "compile",
            "Triton",
            "warn",
            f"triton {version}, but {names} have compute capability below 7.0, which Triton does not support",
            f"tune on a newer GPU, {_NO_COMPILE}",
        )
    return Check("compile", "Triton", "ok", f"{version}, C compiler {cc}: torch.compile can build CUDA kernels")


def _compile_checks(facts: dict[str, Any]) -> list[Check]:
    results = facts.get("compile_check")
    if results is None:
        return [
            Check(
                "compile",
                "compile check",
                "info",
                "not run: autotune doctor --compile-check compiles a tiny function on each device (10-20 s each)",
            )
        ]
    rows = []
    for device, result in results.items():
        name = f"compile check ({device})"
        if result.get("skipped"):
            rows.append(Check("compile", name, "info", f"skipped: {result['skipped']}"))
        elif result.get("ok"):
            rows.append(
                Check("compile", name, "ok", f"a tiny function compiled and matched eager in {result['seconds']:.1f} s")
            )
        else:
            where = "the C++ toolchain (compiler, Python headers: apt install python3-dev)"
            if device.startswith("cuda"):
                where = "that Triton and the CUDA toolkit match this torch release"
            rows.append(
                Check(
                    "compile",
                    name,
                    "fail",
                    f"torch.compile is offered here but failed: {result.get('error')}",
                    f"check {where}, {_NO_COMPILE}",
                )
            )
    return rows
