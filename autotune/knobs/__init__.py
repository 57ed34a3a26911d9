"""Knobs: one file per family, each registering itself in :data:`REGISTRY`.

Import order is the order in which knobs are suggested, so a knob that depends on another
(``prefetch_factor`` on ``num_workers``) comes after it.
"""

from . import batch, compiler, layout, loader, precision, runtime  # noqa: F401  (registers)
from .base import REGISTRY, Knob, Offer, SpaceContext, Stage, get_knob, register

__all__ = ["REGISTRY", "Knob", "Offer", "SpaceContext", "Stage", "get_knob", "register"]
