"""What a trial's exception means: its status, kind and one-line reason."""

from __future__ import annotations

import traceback

import torch

from autotune.errors import TrialError
from autotune.trial.spec import TrialResult

__all__ = ["classify", "one_line", "record_fault"]


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 400:
        text = text[:400] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _from_compiler(exc: BaseException) -> bool:
    if type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return any("/torch/_dynamo/" in f.filename or "/torch/_inductor/" in f.filename for f in frames)


def classify(exc: BaseException) -> tuple[str, str, str]:
    """(status, kind, reason) of a trial that raised ``exc``."""
    if isinstance(exc, TrialError):
        # A method that cannot apply to this model (nothing to quantize, say) rules the
        # candidate out like a guard failure; it says nothing about the rest of the space.
        status = "infeasible" if exc.kind in ("nan", "unsupported") else "oom" if exc.kind == "oom" else "error"
        return status, exc.kind, str(exc)
    if _is_oom(exc):
        return "oom", "oom", one_line(exc)
    if _from_compiler(exc):
        return "error", "compile", one_line(exc)
    return "error", "runtime", one_line(exc)


def record_fault(result: TrialResult, exc: BaseException, device: str) -> None:
    """Record a trial's fault in its result (status, kind, reason); free cached CUDA memory."""
    result.fail(*classify(exc))
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
