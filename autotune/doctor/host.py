"""The doctor's rules for the host: the CPU, memory and disk (each runtime has its own:
:meth:`autotune.runtimes.base.Runtime.doctor_checks`).

Pure functions of the facts dict, like :mod:`autotune.doctor.checks`.
"""

from __future__ import annotations

import math
from typing import Any

from autotune.doctor.base import _DISK_FAIL, _DISK_WARN, _GIB, _SHM_WARN, Check, _gib

__all__ = ["cpu", "system"]


# --- CPU ---------------------------------------------------------------------------------------


def _usable_cores(c: dict[str, Any]) -> float:
    quota = c.get("quota_cores")
    return min(c.get("usable_cores") or c.get("logical_cores") or 1, quota if quota else math.inf)


def cpu(facts: dict[str, Any]) -> list[Check]:
    """The CPU's model and cores, torch's threads against them, instruction sets and load."""
    c = facts["cpu"]
    physical = f"{c['physical_cores']} physical" if c.get("physical_cores") else "physical count unknown"
    detail = (
        f"{c.get('model') or 'unknown model'} ({c.get('machine')}): {c['logical_cores']} logical cores ({physical})"
    )
    detail += f", {c['usable_cores']} in this process's affinity"
    if c.get("quota_cores"):
        detail += f", a cgroup quota of {c['quota_cores']:g} cores"
    rows = [Check("cpu", "cpu", "ok", detail)]
    if "error" in c:
        rows.append(
            Check(
                "cpu",
                "capabilities",
                "fail",
                f"cannot detect what this CPU runs: {c['error']}",
                "reinstall autotune's requirements (pip install -e .)",
            )
        )
        return rows
    return [*rows, _threads(c), _isa(c), _cpu_bf16(c), _cpu_int8(c), _load(c)]


def _threads(c: dict[str, Any]) -> Check:
    usable, threads = _usable_cores(c), c["torch_threads"]
    omp = f"; OMP_NUM_THREADS={c['omp_num_threads']}" if c.get("omp_num_threads") else ""
    if threads > usable:
        return Check(
            "cpu",
            "threads",
            "warn",
            f"torch uses {threads} intra-op threads, but this process may use only {usable:g} cores{omp}: "
            "oversubscribed threads slow every trial",
            f"export OMP_NUM_THREADS={max(1, math.floor(usable))} before running autotune",
        )
    return Check(
        "cpu", "threads", "ok", f"torch uses {threads} intra-op threads; num_threads tunes 1 to {threads}{omp}"
    )


def _isa(c: dict[str, Any]) -> Check:
    isa = c.get("isa") or []
    flags = ", ".join(isa) if isa else "no AVX2, AVX-512 or AMX"
    return Check("cpu", "instruction set", "ok", f"torch dispatches to {c['capability']}; {flags}")


def _cpu_bf16(c: dict[str, Any]) -> Check:
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in (c.get("isa") or [])]
    if native:
        return Check(
            "cpu",
            "bf16 on CPU",
            "ok",
            f"a real candidate: native bfloat16 instructions ({', '.join(native)}); amp_dtype=bfloat16 is offered",
        )
    if c.get("bf16"):
        return Check(
            "cpu",
            "bf16 on CPU",
            "info",
            "offered (AVX-512), but without AVX512-BF16 or AMX it is emulated and rarely beats float32",
        )
    return Check("cpu", "bf16 on CPU", "info", "left out: without AVX-512 or AMX bfloat16 would be emulated slowly")


def _cpu_int8(c: dict[str, Any]) -> Check:
    fast = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in (c.get("isa") or [])]
    if fast:
        return Check(
            "cpu", "int8 on CPU", "ok", f"int8 dot-product instructions ({', '.join(fast)}): quantization can pay off"
        )
    return Check(
        "cpu",
        "int8 on CPU",
        "info",
        "no VNNI or AMX-INT8: int8 quantization mostly shrinks the model; expect little speedup from it",
    )


def _load(c: dict[str, Any]) -> Check:
    from autotune.trial.measure import MeasureSettings

    load, usable, others = c.get("load_1m"), _usable_cores(c), c.get("others_cpu")
    limit = MeasureSettings().max_others_cpu
    if load is None and others is None:
        return Check("cpu", "load", "info", "the load average is not available on this system")
    now = f"other processes use {others:.0%} of the CPU now" if others is not None else ""
    avg = f"1-minute load average {load:.2f} on {usable:g} usable cores" if load is not None else ""
    detail = "; ".join(p for p in (now, avg) if p)
    if (others is not None and others > limit) or (load is not None and load >= max(1.0, 0.5 * usable)):
        return Check(
            "cpu",
            "load",
            "warn",
            f"{detail}: they compete with the trials, so timings are noisy (a trial counts as noisy above "
            f"{limit:.0%}, and no speedup is claimed from rounds that ran beside them)",
            "tune on an otherwise idle machine, and compare only results measured under the same load",
        )
    return Check("cpu", "load", "ok", detail)


# --- memory and disk ---------------------------------------------------------------------------


def system(facts: dict[str, Any]) -> list[Check]:
    """Memory, free disk where results go and in the temp dir, and shared memory for loader workers."""
    s = facts["system"]
    total, available = s["memory_bytes"], s.get("memory_available_bytes")
    if available is not None and available < min(2 * _GIB, 0.1 * total):
        rows = [
            Check(
                "system",
                "memory",
                "warn",
                f"{_gib(available)} of {_gib(total)} available: trials with large batches or many loader workers "
                "will be killed for lack of memory",
                "stop other programs, or keep batch_size and num_workers small (--fix)",
            )
        ]
    else:
        free = f", {_gib(available)} available" if available is not None else ""
        rows = [Check("system", "memory", "ok", f"{_gib(total)} total{free}")]
    rows.append(
        _disk(
            "disk",
            s["disk"],
            "each run writes study.db, trials.csv, logs and the exported models",
            "free space there, or give another --out directory",
        )
    )
    rows.append(
        _disk(
            "temp dir",
            s["tmp"],
            "torch.compile's cache and each TorchScript/ONNX candidate's files go there",
            "free space there, or point TMPDIR at a larger disk",
        )
    )
    if s.get("shm"):
        rows.append(_shm(s["shm"]))
    return rows


def _disk(name: str, disk: dict[str, Any], why: str, fix: str) -> Check:
    if "error" in disk:
        return Check("system", name, "warn", f"cannot read free space of {disk['path']}: {disk['error']}", fix)
    free = disk["free_bytes"]
    detail = f"{_gib(free)} free in {disk['path']}"
    if free < _DISK_FAIL:
        return Check("system", name, "fail", f"{detail}: {why}, and will not fit", fix)
    if free < _DISK_WARN:
        return Check("system", name, "warn", f"{detail}: {why}; large models may not fit", fix)
    return Check("system", name, "ok", detail)


def _shm(shm: dict[str, Any]) -> Check:
    if "error" in shm:
        return Check("system", "shared memory", "info", f"cannot read {shm['path']}: {shm['error']}")
    free = shm["free_bytes"]
    if free < _SHM_WARN:
        return Check(
            "system",
            "shared memory",
            "warn",
            f"{free / 2**20:.0f} MiB free in {shm['path']}: DataLoader workers pass batches through it, so trials "
            "with num_workers > 0 can die with a bus error",
            "give the container more (docker run --shm-size=8g, or --ipc=host), or --fix num_workers=0",
        )
    return Check("system", "shared memory", "ok", f"{_gib(free)} free in {shm['path']} for DataLoader workers")
