"""Model outputs as ``parity.pt`` stores them: tensors, numbers, strings, lists, tuples and dicts
only, so that it loads with ``torch.load(weights_only=True)`` and nothing else is unpickled.

A transformers ``ModelOutput`` is stored as a plain dict of its fields with its class's import
path as a string; reading it back rebuilds that class only if the path names a ``ModelOutput``
subclass of an installed transformers, and leaves the plain dict otherwise.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["from_stored", "output_type", "rebuild_output", "to_stored"]

_TYPE = "__autotune_output_type__"
_FIELDS = "fields"
_BATCHES = "__autotune_batches__"  # outputs kept batch by batch (autotune.shapes.Batches): the chunk


def output_type(obj: Any) -> str | None:
    """The import path of ``obj``'s class when it is a transformers ``ModelOutput``, else ``None``."""
    cls = type(obj)
    if not cls.__module__.startswith("transformers.") or "transformers" not in sys.modules:
        return None
    from transformers.utils import ModelOutput

    return f"{cls.__module__}:{cls.__qualname__}" if isinstance(obj, ModelOutput) else None


def to_stored(obj: Any) -> Any:
    """``obj`` with numpy arrays and scalars as tensors and numbers and each ``ModelOutput`` as
    ``{"__autotune_output_type__": "module:Class", "fields": {...}}``.

    Example:
        >>> import numpy as np
        >>> to_stored({"a": (np.zeros(2), np.float32(1.5))})
        {'a': (tensor([0., 0.], dtype=torch.float64), 1.5)}
    """
    import numpy as np
    import torch

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    from autotune.shapes import Batches

    if isinstance(obj, Batches):
        return {_BATCHES: obj.chunk, "items": [to_stored(v) for v in obj]}
    path = output_type(obj)
    if path is not None:
        return {_TYPE: path, _FIELDS: {k: to_stored(v) for k, v in obj.items()}}
    if isinstance(obj, Mapping):  # a collator's batch (transformers' BatchEncoding) as a plain dict
        return {k: to_stored(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_stored(v) for v in obj)
    return obj


def from_stored(obj: Any) -> Any:
    """What :func:`to_stored` wrote, with each ``ModelOutput`` rebuilt (see :func:`rebuild_output`)."""
    if isinstance(obj, dict) and isinstance(obj.get(_BATCHES), int) and isinstance(obj.get("items"), list):
        from autotune.shapes import Batches

        return Batches([from_stored(v) for v in obj["items"]], chunk=obj[_BATCHES])
    if isinstance(obj, dict) and isinstance(obj.get(_TYPE), str) and isinstance(obj.get(_FIELDS), dict):
        return rebuild_output(obj[_TYPE], {k: from_stored(v) for k, v in obj[_FIELDS].items()})
    if isinstance(obj, dict):
        return {k: from_stored(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(from_stored(v) for v in obj)
    return obj


def rebuild_output(path: Any, fields: dict[str, Any]) -> Any:
    """``fields`` as the ``ModelOutput`` class at ``path`` ("module:Class"); the plain dict when
    the path names anything else, or transformers is not installed. Only modules of the
    transformers package are imported, and only a ``ModelOutput`` subclass is called.

    Example:
        >>> rebuild_output("os:system", {"a": 1})
        {'a': 1}
    """
    module, _, name = str(path).partition(":")
    if module.split(".")[0] != "transformers" or not name or "." in name:
        return fields
    try:
        from transformers.utils import ModelOutput

        cls = getattr(importlib.import_module(module), name, None)
    except Exception:  # transformers missing or another version: the fields as they are
        return fields
    if not (isinstance(cls, type) and issubclass(cls, ModelOutput)):
        return fields
    return cls(**fields)
