"""The doctor's vocabulary: a :class:`Check` and the thresholds every section shares."""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.runtimes.base import names

__all__ = ["SECTIONS", "STATUSES", "Check", "sections"]

STATUSES = ("ok", "info", "warn", "fail")


def sections() -> tuple[str, ...]:
    """The doctor's sections, in the order it prints them: the host's, one per registered runtime
    (its name; empty where it checks nothing), the system's."""
    return ("software", "cuda", "gpu", "cpu", "compile", *names(), "system")


SECTIONS = sections()  # those of the runtimes registered when the doctor is imported

_GIB = 2**30
_PACKAGES = (
    "torch",
    "optuna",
    "numpy",
    "onnx",
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxscript",
    "onnxslim",
    "openvino",
    "nncf",
    "torchao",
    "torch-pruning",
    "triton",
)
# Without these autotune cannot run at all; any other unmet requirement only disables a feature.
_ESSENTIAL = ("torch", "optuna", "numpy")
_DISK_WARN, _DISK_FAIL = 5 * _GIB, _GIB // 2
_SHM_WARN = _GIB
_NO_COMPILE = "or leave compile_mode out (--fix compile_mode=none); autotune leaves it out by itself when it cannot run"


@dataclasses.dataclass(frozen=True)
class Check:
    """One finding of the doctor.

    Attributes:
        section: One of :func:`sections` (a runtime's section is its name).
        name: What was checked, e.g. ``"C++ compiler"``.
        status: ``"ok"``, ``"info"`` (a fact, nothing to do), ``"warn"`` (tuning runs, but
            something is lost or noisy) or ``"fail"`` (fix it before tuning).
        detail: What was found, in one line.
        fix: What to do about it; ``None`` when nothing needs doing.
    """

    section: str
    name: str
    status: str
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The check as a JSON-safe dict."""
        return dataclasses.asdict(self)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / _GIB:.1f} GiB"


def _gpu_list(facts: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = facts.get("gpus") or []
    return [g for g in gpus if isinstance(g, dict) and "index" in g] if isinstance(gpus, list) else []
