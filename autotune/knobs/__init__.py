"""Knobs: one file per family, each registering itself in :data:`REGISTRY`.

:data:`REGISTRY` is ordered as the pipeline reads: batch, loader, precision, layout,
compilation, runtime settings. A knob that depends on another (``prefetch_factor`` on
``num_workers``) comes after it, since configurations are suggested in this order.
"""

from . import backend, batch, compiler, compress, layout, loader, precision, runtime, train  # noqa: F401  (registers the knobs)
from .base import REGISTRY, Knob, Offer, SpaceContext, Stage, get_knob, register

_ORDER = (
    "batch_size",
    "num_workers",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory",
    "prune_ratio",
    "prune_method",
    "finetune_steps",
    "runtime",
    "quantization",
    "amp_dtype",
    "channels_last",
    "compile_mode",
    "ort_provider",
    "ort_precision",
    "ort_graph_optimization",
    "ort_io_binding",
    "num_threads",
    "cudnn_benchmark",
    "tf32",
    "optimizer_impl",
)
_registered = dict(REGISTRY)
REGISTRY.clear()
REGISTRY.update({name: _registered.pop(name) for name in _ORDER})
REGISTRY.update(_registered)  # knobs added later keep their import order, after these

__all__ = ["REGISTRY", "Knob", "Offer", "SpaceContext", "Stage", "get_knob", "register"]
