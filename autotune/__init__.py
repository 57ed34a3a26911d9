"""autotune: find the fastest configuration of a PyTorch model whose accuracy holds.

Example:
    >>> import autotune
    >>> result = autotune.optimize(model, dataset, n_trials=30)  # doctest: +SKIP
    >>> fast_model = autotune.apply(model, result.best_config)  # doctest: +SKIP

The heavy modules (torch, optuna) are imported on first use of a name, never by
``import autotune``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import AutotuneError, ConfigError, ExportError, InputError, TrialError

__version__ = "0.1.0"

__all__ = [
    "AutotuneError",
    "Config",
    "ConfigError",
    "ExportError",
    "InputError",
    "Result",
    "TrialError",
    "apply",
    "dataloader",
    "load",
    "load_config",
    "optimize",
    "plan",
    "training",
    "verify",
    "__version__",
]

_LAZY = {
    "Config": "autotune.config",
    "Result": "autotune._result",
    "apply": "autotune._apply",
    "dataloader": "autotune._apply",
    "optimize": "autotune._optimize",
    "plan": "autotune._optimize",
    "training": "autotune._apply",
    "load_config": "autotune._cfg",
    "load": "autotune._load",
    "verify": "autotune._verify",
}

if TYPE_CHECKING:
    from ._apply import apply, dataloader, training
    from ._cfg import load_config
    from ._load import load
    from ._optimize import optimize, plan
    from ._result import Result
    from ._verify import verify
    from .config import Config


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
