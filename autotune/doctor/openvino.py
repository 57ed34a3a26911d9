"""The doctor's OpenVINO section: whether ``runtime=openvino`` is offered here, and which of its
precisions pay on this CPU.

:func:`facts` collects (it imports ``openvino``, never NNCF, which imports torch); :func:`checks`
is a pure function of them, like the other sections' rules.
"""

from __future__ import annotations

from typing import Any

from autotune.doctor.base import Check

__all__ = ["checks", "facts"]


def facts() -> dict[str, Any]:
    """OpenVINO's and NNCF's versions, why OpenVINO cannot run here (``problem``, ``None`` when
    it can), and the CPU plugin's optimization capabilities (``FP32``, ``BF16``, ``INT8``, ...)."""
    from importlib import metadata

    from autotune.export.ov_run import core, openvino_problem

    found: dict[str, Any] = {"version": None, "nncf": None, "problem": openvino_problem(), "capabilities": []}
    for key, dist in (("version", "openvino"), ("nncf", "nncf")):
        try:
            found[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if found["problem"] is None:
        try:
            found["capabilities"] = [str(c) for c in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
        except Exception as exc:  # an older plugin without the property: the rows say unknown
            found["capabilities_error"] = f"{type(exc).__name__}: {exc}"
    return found


def checks(all_facts: dict[str, Any]) -> list[Check]:
    """Whether ``runtime=openvino`` is offered (and, where not, why and how to fix it), whether
    NNCF is there for its int8, and whether its bf16 precision pays on this CPU."""
    ov = all_facts.get("openvino")
    if not isinstance(ov, dict):
        return []  # facts recorded before the section existed
    if "error" in ov:
        return [Check("openvino", "openvino", "warn", f"cannot be checked: {ov['error']}")]
    if ov.get("problem"):
        return [
            Check(
                "openvino",
                "openvino",
                "info",
                f"runtime=openvino is left out: {ov['problem']}",
                "install the openvino extra (x86-64 Linux) or pip install openvino nncf, to let OpenVINO compete on the CPU",
            )
        ]
    caps = ", ".join(ov.get("capabilities") or []) or "unknown"
    rows = [Check("openvino", "openvino", "ok", f"{ov['version']}: runtime=openvino is offered on the CPU ({caps})")]
    if ov.get("nncf"):
        rows.append(Check("openvino", "nncf", "ok", f"{ov['nncf']}: ov_precision=int8_static (NNCF static int8)"))
    else:
        rows.append(
            Check(
                "openvino",
                "nncf",
                "warn",
                "not installed: OpenVINO's int8 (ov_precision=int8_static) fails in every trial that tries it",
                "pip install nncf",
            )
        )
    isa = set((all_facts.get("cpu") or {}).get("isa") or [])
    if {"avx512_bf16", "amx_bf16"} & isa:
        rows.append(Check("openvino", "bf16", "ok", "this CPU has bf16 units: ov_precision=bf16 is offered"))
    else:
        rows.append(
            Check(
                "openvino", "bf16", "info", "no bf16 units on this CPU: ov_precision=bf16 is left out (emulated, slow)"
            )
        )
    return rows
