"""Knobs: one module per family, each registering its knobs in :data:`REGISTRY`.

Every module of this package is imported here, so a new knob is one new file (a :class:`Knob`
subclass decorated with :func:`register`); no list names it. :data:`REGISTRY` is ordered by each
knob's declared ``order``, as the pipeline reads: batch, loader, compression, runtime,
precision, layout, compilation, runtime settings. A knob that depends on another
(``prefetch_factor`` on ``num_workers``) comes after it, since configurations are suggested in
this order.
"""

import importlib
import pkgutil
from typing import Any

from autotune.knobs.base import REGISTRY, Knob, Offer, SpaceContext, Stage, get_knob, register

_NOT_KNOBS = {"base", "state"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _NOT_KNOBS:
        importlib.import_module(f"{__name__}.{_module.name}")
_registered = sorted(REGISTRY.values(), key=lambda k: (k.order, k.name))
REGISTRY.clear()
REGISTRY.update({k.name: k for k in _registered})

__all__ = ["REGISTRY", "Knob", "Offer", "SpaceContext", "Stage", "declared", "get_knob", "off_default", "register"]


def declared(attr: str, *values: object) -> tuple[str, ...]:
    """The names of the knobs that declare ``attr`` (``heavy``, ``prices``, ``held``,
    ``first_tier``, ``memory``, ``deploy``: see :class:`Knob`), in registry order; with
    ``values``, those whose ``attr`` is one of them (``side``, ``code``).

    Example:
        >>> "compile_mode" in declared("heavy"), "batch_size" in declared("heavy")
        (True, False)
        >>> declared("side", "both")
        ('batch_size',)
    """
    return tuple(
        name for name, knob in REGISTRY.items() if (getattr(knob, attr) in values if values else getattr(knob, attr))
    )


def off_default(config: Any, attr: str) -> tuple[str, ...]:
    """The knobs declaring ``attr`` (see :func:`declared`) that ``config`` sets off their
    default, where they apply given its other values.

    Example:
        >>> off_default({"runtime": "openvino", "compile_mode": "default"}, "reads_inputs")
        ('runtime',)
    """
    return tuple(
        name
        for name in declared(attr)
        if name in config and config[name] != REGISTRY[name].default and REGISTRY[name].applies(config)
    )
