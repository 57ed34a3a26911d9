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

from autotune.errors import AutotuneError, ConfigError, ExportError, InputError, TrialError

__version__ = "0.1.0"

__all__ = [
    "AutotuneError",
    "Config",
    "ConfigError",
    "ExportError",
    "InputError",
    "Predictor",
    "Result",
    "TrialError",
    "apply",
    "collect",
    "dataloader",
    "load",
    "load_config",
    "optimize",
    "plan",
    "predict",
    "predictor",
    "profile",
    "training",
    "verify",
    "__version__",
]

_LAZY = {
    "Config": "autotune.config",
    "Result": "autotune.record",
    "apply": "autotune.run.apply",
    "collect": "autotune.run.collect",
    "dataloader": "autotune.run.apply",
    "optimize": "autotune.run.optimize",
    "plan": "autotune.run.plan",
    "predict": "autotune.run.predict",
    "predictor": "autotune.run.predict",
    "Predictor": "autotune.run.predict",
    "profile": "autotune.run.profile",
    "training": "autotune.run.training",
    "load_config": "autotune.run.cfg",
    "load": "autotune.deploy.entry",  # torch-free for an OpenVINO artifact, else autotune.deploy.serve.load
    "verify": "autotune.deploy.verify",
}

if TYPE_CHECKING:
    from autotune.config import Config
    from autotune.deploy.entry import load
    from autotune.deploy.verify import verify
    from autotune.record import Result
    from autotune.run.apply import apply, dataloader
    from autotune.run.cfg import load_config
    from autotune.run.collect import collect
    from autotune.run.optimize import optimize
    from autotune.run.plan import plan
    from autotune.run.predict import Predictor, predict, predictor
    from autotune.run.profile import profile
    from autotune.run.training import training


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
