"""The doctor's vocabulary: a :class:`Check` and the thresholds every section shares."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["SECTIONS", "STATUSES", "Check"]

STATUSES = ("ok", "info", "warn", "fail")
SECTIONS = ("software", "cuda", "gpu", "cpu", "compile", "onnxruntime", "openvino", "system")

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
_ORT_DISTS = ("onnxruntime", "onnxruntime-gpu")  # one module, two wheels: either satisfies the other
_DISK_WARN, _DISK_FAIL = 5 * _GIB, _GIB // 2
_SHM_WARN = _GIB
_PROVIDERS_TO_LOAD = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
_NO_COMPILE = "or leave compile_mode out (--fix compile_mode=none); autotune leaves it out by itself when it cannot run"


@dataclasses.dataclass(frozen=True)
class Check:
    """One finding of the doctor.

    Attributes:
        section: One of :data:`SECTIONS`.
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
