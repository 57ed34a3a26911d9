"""OpenVINO here, without torch: whether it runs (:func:`openvino_problem`), the settings a CPU
model is compiled with (:func:`compile_config`), and :class:`OvRunner`, which runs an IR file or
an in-memory model on numpy arrays.

Nothing here imports torch, so a deployment that has only ``openvino`` and ``numpy`` serves an
OpenVINO winner with it (:mod:`autotune.deploy.light`).

Example:
    >>> openvino_problem() is None or "openvino" in openvino_problem()
    True
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.errors import ConfigError, InputError

__all__ = ["HINTS", "INSTALL", "PRECISIONS", "OvRunner", "compile_config", "core", "openvino_problem"]

# OpenVINO and NNCF come with autotune's `openvino` extra (x86-64 Linux), or by hand elsewhere.
INSTALL = "install the openvino extra, or pip install openvino nncf"
# The CPU plugin's inference precision: float32, or bfloat16 where the CPU has bf16 units.
PRECISIONS = ("f32", "bf16")
# The performance hint: one stream with every thread (latency), or several streams, each batch
# split over as many infer requests as OpenVINO finds best (throughput).
HINTS = ("latency", "throughput")


def openvino_problem() -> str | None:
    """Why OpenVINO cannot run here, in one line, or ``None`` when it imports and has a CPU device.

    Example:
        >>> openvino_problem() in (None,) or isinstance(openvino_problem(), str)
        True
    """
    try:
        ov = importlib.import_module("openvino")
    except ImportError:
        return f"openvino is not installed: {INSTALL}"
    except Exception as exc:  # a broken install
        return f"openvino is installed but fails to import ({type(exc).__name__}: {exc}); reinstall it: {INSTALL}"
    try:
        devices = list(core(ov).available_devices)
    except Exception as exc:
        return f"OpenVINO's runtime does not start here: {type(exc).__name__}: {exc}"
    return None if "CPU" in devices else f"OpenVINO has no CPU device here (it has {', '.join(devices) or 'none'})"


@functools.cache
def _core(ov: Any) -> Any:
    return ov.Core()


def core(ov: Any = None) -> Any:
    """The process's one ``openvino.Core`` (models compiled in it share its thread pools and caches)."""
    return _core(ov if ov is not None else importlib.import_module("openvino"))


def compile_config(precision: str = "f32", hint: str = "latency", threads: int = 0) -> dict[str, Any]:
    """The CPU plugin's properties for a model: ``INFERENCE_PRECISION_HINT``, ``PERFORMANCE_HINT``
    and, when ``threads`` is set, ``INFERENCE_NUM_THREADS``.

    Raises:
        ConfigError: an unknown precision or hint, or negative threads.

    Example:
        >>> compile_config("bf16", "throughput", 4)
        {'INFERENCE_PRECISION_HINT': 'bf16', 'PERFORMANCE_HINT': 'THROUGHPUT', 'INFERENCE_NUM_THREADS': 4}
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"No OpenVINO inference precision {precision!r}. Known: {', '.join(PRECISIONS)}.")
    if hint not in HINTS:
        raise ConfigError(f"No OpenVINO performance hint {hint!r}. Known: {', '.join(HINTS)}.")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ConfigError(f"`threads` must be an integer >= 0 (0: OpenVINO's choice), but got {threads!r}.")
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": hint.upper()}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    return config


class OvRunner:
    """An OpenVINO model compiled for the CPU, run on numpy arrays: positional arrays in
    ``input_names`` order or a dict by name, a list of arrays out in ``output_names`` order.

    With the throughput hint a batch is split along its first axis over the infer requests
    OpenVINO finds best (``OPTIMAL_NUMBER_OF_INFER_REQUESTS``), run at once on its streams, and
    the outputs joined; with the latency hint one request runs it whole. The compiled model is
    made on first use and dropped when pickled.

    Args:
        model: An IR file (``model.xml``, its weights in ``model.bin`` beside it) or an
            ``openvino.Model``.
        input_names: The model's inputs, in positional order.
        output_names: The model's outputs, in order.
        precision: ``"f32"`` or ``"bf16"`` (``INFERENCE_PRECISION_HINT``).
        hint: ``"latency"`` or ``"throughput"``.
        threads: ``INFERENCE_NUM_THREADS``; 0 lets OpenVINO choose.

    Example:
        >>> runner = OvRunner("model.xml", ["input_0"], ["output"])  # doctest: +SKIP
        >>> runner.run([np.ones((8, 4), np.float32)])[0].shape  # doctest: +SKIP
        (8, 2)
    """

    def __init__(
        self,
        model: Any,
        input_names: Sequence[str],
        output_names: Sequence[str],
        *,
        precision: str = "f32",
        hint: str = "latency",
        threads: int = 0,
    ) -> None:
        self.config = compile_config(precision, hint, threads)
        self.model = os.fspath(model) if isinstance(model, (str, os.PathLike)) else model
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.precision, self.hint, self.threads = precision, hint, threads
        self._compiled: Any = None
        self._request: Any = None
        self._queue: Any = None

    def __getstate__(self) -> dict[str, Any]:
        if not isinstance(self.model, str):
            raise InputError("An OvRunner on an in-memory model does not pickle: save the model as IR first.")
        return {**self.__dict__, "_compiled": None, "_request": None, "_queue": None}

    @property
    def compiled(self) -> Any:
        """The ``openvino.CompiledModel``, compiled on first use."""
        if self._compiled is None:
            self._compiled = core().compile_model(self.model, "CPU", self.config)
            self._request = self._compiled.create_infer_request()
        return self._compiled

    def properties(self) -> dict[str, Any]:
        """What the plugin made of the settings: its streams, threads, infer requests and precision."""
        names = {
            "streams": "NUM_STREAMS",
            "threads": "INFERENCE_NUM_THREADS",
            "n_requests": "OPTIMAL_NUMBER_OF_INFER_REQUESTS",
            "precision": "INFERENCE_PRECISION_HINT",
        }
        found = {}
        for key, name in names.items():
            try:
                value = self.compiled.get_property(name)
            except Exception:  # a property this OpenVINO version does not report
                continue
            if hasattr(value, "get_type_name"):  # an element type: "f32", "bf16"
                value = value.get_type_name()
            found[key] = value if isinstance(value, (int, float, bool)) else str(value)
        return found

    def feeds(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Positional arrays onto the input names in order, keyword ones by name, each as the
        type the model takes."""
        import numpy as np

        if len(args) > len(self.input_names):
            raise InputError(
                f"The model takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), but got {len(args)} positional."
            )
        named = dict(zip(self.input_names, args, strict=False))
        for name, value in kwargs.items():
            if name not in self.input_names or name in named:
                raise InputError(f"Unexpected or repeated input {name!r}. Known: {', '.join(self.input_names)}.")
            named[name] = value
        missing = [n for n in self.input_names if n not in named]
        if missing:
            raise InputError(f"Missing model inputs: {', '.join(missing)}.")
        ports = {p.get_any_name(): p for p in self.compiled.inputs}
        out = {}
        for name in self.input_names:
            array = np.asarray(named[name])
            port = ports.get(name)
            if port is not None:
                array = np.ascontiguousarray(array, dtype=port.get_element_type().to_dtype())
            out[name] = array
        return out

    def run(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """The model's outputs on one batch, as numpy arrays in ``output_names`` order."""
        feeds = self.feeds(args, kwargs or {})
        n = _batch(feeds)
        parts = self._parts(n)
        if parts <= 1:
            return list(self._request.infer(feeds, share_inputs=True, share_outputs=False).to_tuple())
        return self._split(feeds, n, parts)

    def _parts(self, n: int) -> int:
        if self.hint != "throughput" or n < 2:
            self.compiled  # noqa: B018 (compiles, and makes the one request of the latency path)
            return 1
        return min(n, int(self.properties().get("n_requests", 1)))

    def _split(self, feeds: dict[str, Any], n: int, parts: int) -> list[Any]:
        """``feeds`` split into ``parts`` slices along the batch axis, run at once, joined."""
        import numpy as np
        import openvino as ov

        if self._queue is None:
            self._queue = ov.AsyncInferQueue(self.compiled, parts)
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        results: list[Any] = [None] * parts

        def done(request: Any, index: int) -> None:
            results[index] = [t.data.copy() for t in request.output_tensors]

        self._queue.set_callback(done)
        for i in range(parts):
            part = {k: v[bounds[i] : bounds[i + 1]] if v.ndim else v for k, v in feeds.items()}
            self._queue.start_async(part, i, share_inputs=True)
        self._queue.wait_all()
        outs = []
        for j in range(len(results[0])):
            pieces = [r[j] for r in results]
            if any(p.ndim == 0 or p.shape[0] != bounds[i + 1] - bounds[i] for i, p in enumerate(pieces)):
                raise InputError("An output has no batch axis: run this model with the latency hint (ov_hint=latency).")
            outs.append(np.concatenate(pieces))
        return outs


def _batch(feeds: Mapping[str, Any]) -> int:
    sizes = {int(a.shape[0]) for a in feeds.values() if a.ndim}
    return sizes.pop() if len(sizes) == 1 else 0
