"""Lazy re-exports for the phase packages: ``import autotune.trial`` imports nothing heavy, and a
name is loaded from its module on first use (PEP 562).

Each package's ``__init__`` lists its public names and the module each lives in; the modules
inside a package import one another directly, never through the package, so no import circle
runs through an ``__init__``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["exports"]


def exports(package: str, names: Mapping[str, str]) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package``, whose public ``names`` map to the
    submodule (relative to the package) that defines each.

    Example:
        >>> __all__, __getattr__, __dir__ = exports("autotune.trial", {"TrialResult": "spec"})
        >>> __getattr__("TrialResult").__name__
        'TrialResult'
    """
    table = dict(names)

    def attribute(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{table[name]}"), name)

    def listing() -> list[str]:
        return sorted(table)

    return sorted(table), attribute, listing
