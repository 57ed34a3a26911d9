"""Check this machine before tuning: what ``autotune doctor`` prints.

:func:`gather` collects the facts (versions, driver, GPUs, CPU, compilers, ONNX Runtime
providers, OpenVINO, memory and disk) into a JSON-safe dict, reusing :mod:`autotune.env` for everything
a study also records, and runs the probes of :mod:`autotune.doctor.probe`; each runtime collects
its own section (:meth:`~autotune.runtimes.base.Runtime.doctor_facts`). :func:`diagnose` turns
facts into :class:`Check` rows with the rules of :mod:`autotune.doctor.checks`,
:mod:`autotune.doctor.host` and each runtime's (:meth:`~autotune.runtimes.base.Runtime.doctor_checks`);
it is a pure function, so facts recorded on one machine can be diagnosed anywhere. Nothing heavy
is imported, and CUDA is not touched, until :func:`gather` runs.

Example:
    >>> from autotune.doctor.core import diagnose, gather
    >>> checks = diagnose(gather())  # doctest: +SKIP
    >>> [c.name for c in checks if c.status == "fail"]  # doctest: +SKIP
    []
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from autotune.doctor.base import (  # noqa: F401  (re-exported: the doctor's public vocabulary)
    _DISK_FAIL,
    _DISK_WARN,
    _ESSENTIAL,
    _GIB,
    _NO_COMPILE,
    _PACKAGES,
    _SHM_WARN,
    SECTIONS,
    STATUSES,
    Check,
    sections,
)
from autotune.runtimes.base import REGISTRY, Runtime, names

__all__ = ["SECTIONS", "STATUSES", "Check", "diagnose", "exit_code", "gather", "run_checks", "sections"]


def run_checks(workdir: str | os.PathLike = ".", *, compile_check: bool = False) -> list[Check]:
    """Gather this machine's facts and diagnose them: ``diagnose(gather(...))``."""
    return diagnose(gather(workdir, compile_check=compile_check))


def exit_code(checks: list[Check]) -> int:
    """1 when any check failed, else 0 (the exit code of ``autotune doctor``)."""
    return 1 if any(c.status == "fail" for c in checks) else 0


# --- gathering ---------------------------------------------------------------------------------


def gather(
    workdir: str | os.PathLike = ".", *, compile_check: bool = False, compile_timeout: float = 300.0
) -> dict[str, Any]:
    """Collect the facts the checks need, as a JSON-safe dict.

    A part that cannot be collected (torch missing, say) is recorded as ``{"error": ...}``
    instead of raising: the doctor reports it as a failed check.

    Args:
        workdir: The directory where results will be written (its free disk is checked).
        compile_check: Also compile a tiny function with ``torch.compile`` on the CPU and on
            each GPU, in a fresh process with an empty compile cache (10-20 s each).
        compile_timeout: Seconds one compile check may take.
    """
    import autotune.env as env

    facts: dict[str, Any] = {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation()},
        "packages": _packages(),
        "requirements": _requirements(),
        "driver": env.nvidia_driver(),
        "torch": _guarded(_torch_facts),
        "cpu": {**env.cpu_info(), **_guarded(_cpu_env)},
        "compilers": {"cxx": env.cxx_compiler(), "cc": env.c_compiler()},
        "system": _system_facts(Path(workdir)),
    }
    facts["gpus"] = _guarded(_gpu_facts) if facts["torch"].get("cuda_available") else []
    on_cuda = bool(facts["gpus"]) and "error" not in facts["gpus"]
    for runtime in _runtimes():  # each runtime's own section (ONNX Runtime's providers, OpenVINO's CPU plugin)
        found = _guarded(lambda runtime=runtime: runtime.doctor_facts(on_cuda))
        if found is not None:
            facts[runtime.name] = found
    facts["compile_check"] = None
    if compile_check and "error" not in facts["torch"]:
        facts["compile_check"] = _compile_checks(facts, compile_timeout)
    return facts


def _compile_checks(facts: dict[str, Any], timeout: float) -> dict[str, dict[str, Any]]:
    """The tiny compile on each device; skipped where a missing tool already rules it out (the
    compiler rows say which), since autotune then leaves compile_mode out by itself."""
    from autotune.doctor.probe import compile_probe

    results: dict[str, dict[str, Any]] = {}
    if facts["compilers"]["cxx"] is None:
        results["cpu"] = {"ok": False, "skipped": "no C++ compiler (see the C++ compiler row)"}
    else:
        results["cpu"] = compile_probe("cpu", timeout)
    for gpu in facts["gpus"] if isinstance(facts["gpus"], list) else []:
        device = f"cuda:{gpu['index']}"
        if not gpu["triton"]:
            results[device] = {"ok": False, "skipped": "Triton is not installed (see the Triton row)"}
        else:
            results[device] = compile_probe(device, timeout)
    return results


def _guarded(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # any failure to collect is itself the finding
        return {"error": f"{type(exc).__name__}: {exc}"}


def _packages() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _requirements() -> list[dict[str, Any]] | None:
    """autotune's own install requirements with what is installed; ``None`` when unknown."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:
        return None
    # The distribution is torch-autotune (the import name stays autotune); an older checkout's is autotune.
    dists = metadata.packages_distributions().get("autotune") or []
    dist = "torch-autotune" if "torch-autotune" in dists or not dists else dists[0]
    try:
        required = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return None
    rows = []
    for text in required:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # another platform's requirement, or an optional extra
        # A runtime's package may come in several wheels (ONNX Runtime's): any one satisfies the others.
        wheels = next((r.packages for r in _runtimes() if req.name in r.packages), (req.name,))
        installed = None
        for name in wheels:
            try:
                installed = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
        ok = installed is not None and req.specifier.contains(installed, prereleases=True)
        rows.append({"name": req.name, "requirement": str(req), "installed": installed, "ok": ok})
    return rows


def _torch_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if torch.version.cuda else None,
        "arch_list": list(torch.cuda.get_arch_list()) if torch.version.cuda else [],
        "cuda_available": bool(torch.cuda.is_available()),
        "device_count": torch.cuda.device_count() if torch.version.cuda else 0,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported

        facts["dynamo_supported"] = bool(is_dynamo_supported())
    except Exception:  # a torch without dynamo, or one that fails to import it here
        facts["dynamo_supported"] = False
    return facts


def _cpu_env() -> dict[str, Any]:
    from autotune.env import Env

    manifest = Env.detect("cpu").manifest()
    return {
        "capability": manifest["cpu_capability"],
        "bf16": manifest["bf16"],
        "torch_threads": manifest["cpu_threads"],
        "memory_bytes": manifest["device_mem_bytes"],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "others_cpu": _others_cpu(),
    }


def _others_cpu(seconds: float = 1.0) -> float | None:
    """Share of the machine's CPU (0-1) that other processes use now, sampled for ``seconds``:
    the same figure the trials' noise check uses (:class:`autotune.trial.measure.Interference`)."""
    import time

    from autotune.trial.measure import Interference

    try:
        probe = Interference()
        probe.start()
        time.sleep(seconds)
        return probe.stop()
    except Exception:  # no /proc/stat, say: the load average still speaks
        return None


def _gpu_facts() -> list[dict[str, Any]]:
    import torch

    from autotune.env import Env

    gpus = []
    for index in range(torch.cuda.device_count()):
        manifest = Env.detect(f"cuda:{index}").manifest()
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(
            {
                "index": index,
                "name": manifest["gpu_name"],
                "capability": manifest["gpu_capability"],
                "memory_bytes": int(total),
                "free_bytes": int(free),
                "multiprocessors": int(props.multi_processor_count),
                "bf16": manifest["bf16"],
                "fp16": manifest["fp16"],
                "triton": manifest["compiler"] is not None,
            }
        )
    return gpus


def _system_facts(workdir: Path) -> dict[str, Any]:
    import shutil
    import tempfile

    from autotune.env import _mem_bytes

    def disk(path: Path) -> dict[str, Any]:
        # The directory may not exist yet (autotune creates it): its nearest existing parent decides.
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            usage = shutil.disk_usage(path)
        except OSError as exc:
            return {"path": str(path), "error": str(exc)}
        return {"path": str(path), "free_bytes": usage.free, "total_bytes": usage.total}

    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except Exception:  # psutil missing: total memory only
        available = None
    return {
        "memory_bytes": _mem_bytes(),
        "memory_available_bytes": available,
        "disk": disk(workdir.resolve()),
        "tmp": disk(Path(tempfile.gettempdir())),
        "shm": disk(Path("/dev/shm")) if Path("/dev/shm").is_dir() else None,
    }


def _runtimes() -> list[Runtime]:
    """The registered runtimes, in their order: the doctor's sections between the host's."""
    return [REGISTRY[name] for name in names()]


# --- diagnosing --------------------------------------------------------------------------------


def diagnose(facts: dict[str, Any]) -> list[Check]:
    """Turn facts from :func:`gather` (possibly recorded elsewhere) into checks, in section order."""
    import autotune.doctor.checks as stack
    import autotune.doctor.host as host

    found: list[Check] = []
    for part in (stack.software, stack.cuda, stack.gpus, host.cpu, stack.compiler, _runtime_checks, host.system):
        found += part(facts)
    return found


def _runtime_checks(facts: dict[str, Any]) -> list[Check]:
    """Each runtime's rows (:meth:`~autotune.runtimes.base.Runtime.doctor_checks`), in its own section."""
    return [Check(runtime.name, **row) for runtime in _runtimes() for row in runtime.doctor_checks(facts)]
