"""Runtimes: one module per runtime that runs a tuned model in place of PyTorch, each a
:class:`Runtime` subclass registered in :data:`REGISTRY` (``torchscript``, ``onnxruntime``,
``openvino``).

Every module of this package is imported here, so a new runtime is one new file; the
``runtime`` knob, the export of the run's artifacts (:mod:`autotune.runtimes.artifacts`) and
:func:`autotune.load` find it in the registry. The modules import their runtime's package
(onnxruntime, openvino) inside their methods only: importing them costs nothing.
"""

import importlib
import pkgutil

from autotune.runtimes.base import REGISTRY, Runtime, by_format, formats, get_runtime, names, register

_NOT_RUNTIMES = {"artifacts", "base"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _NOT_RUNTIMES:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["REGISTRY", "Runtime", "by_format", "formats", "get_runtime", "names", "register"]
