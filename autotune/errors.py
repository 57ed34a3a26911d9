"""The exceptions autotune raises.

Every error a user can cause is an :class:`AutotuneError`; children also inherit the builtin
that fits, so ``except ValueError`` keeps working for callers that expect it.
"""

from __future__ import annotations

__all__ = ["AutotuneError", "ConfigError", "ExportError", "InputError", "TrialError"]


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose."""


class ConfigError(AutotuneError, ValueError):
    """An option, preset, knob name or knob value is invalid."""


class InputError(AutotuneError, ValueError):
    """The model, the dataset or cfg.py cannot be used as given."""


class ExportError(AutotuneError, RuntimeError):
    """An artifact could not be written or failed its parity check."""


class TrialError(AutotuneError, RuntimeError):
    """A trial failed in a way that has a kind.

    Args:
        kind: One of ``oom``, ``timeout``, ``crash``, ``compile``, ``nan``, ``unsupported`` (a
            method that cannot apply to this model), ``error``.
        message: What happened, in one line.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
