"""ONNX Runtime here: which execution provider a session really runs on (:func:`provider_for`,
:func:`provider_problem`), and :class:`OrtModule`, which runs an ONNX file like the model it was
exported from.

ONNX Runtime lists every provider its build has (``get_available_providers()``) whether or not
the provider's libraries load here, and a session whose provider fails to load logs the error and
runs on the CPU without raising. So a provider is judged by a session: one on a one-node graph,
made once per provider and process, whose ``get_providers()`` says what it really got.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from autotune.errors import ConfigError, InputError

__all__ = [
    "CPU_PROVIDER",
    "CUDA_PROVIDER",
    "GPU_PROVIDERS",
    "GRAPH_OPTIMIZATIONS",
    "OrtModule",
    "provider_for",
    "provider_problem",
]

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
# The providers that run a graph on a CUDA device.
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
GRAPH_OPTIMIZATIONS = ("disable", "basic", "extended", "all")


def provider_problem(provider: str) -> str | None:
    """Why a session asked for ``provider`` does not run on it here, in one line, or ``None`` when
    it does (a session on a one-node graph is made once per provider and process to tell).

    Example:
        >>> provider_problem("CPUExecutionProvider") is None
        True
    """
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None:
        return "onnxruntime is not installed"
    return None if provider == CPU_PROVIDER else _probe(provider)


def provider_for(device: str, wanted: str | None = None) -> str:
    """The provider an ONNX Runtime session for ``device`` really runs on here.

    On a CUDA device: ``wanted`` (default the CUDA provider) where a session gets it, else the
    CUDA provider where a session gets that, else the CPU's. On the CPU, the CPU's.

    Example:
        >>> provider_for("cpu", "CUDAExecutionProvider")
        'CPUExecutionProvider'
    """
    if not str(device).startswith("cuda") or wanted == CPU_PROVIDER:
        return CPU_PROVIDER
    for provider in dict.fromkeys([wanted or CUDA_PROVIDER, CUDA_PROVIDER]):
        if provider_problem(provider) is None:
            return provider
    return CPU_PROVIDER


@functools.cache
def _probe(provider: str) -> str | None:
    import onnxruntime as ort

    listed = ort.get_available_providers()
    if provider not in listed:
        return f"not in this onnxruntime build (it has {', '.join(listed)})"
    try:
        with _captured_log() as log:
            session = ort.InferenceSession(_one_node_graph(), providers=[provider, CPU_PROVIDER])
            session.run(None, {"x": np.ones(2, np.float32)})
        ran = session.get_providers()[0]
    except Exception as exc:  # a provider that raises instead of falling back is as absent
        return f"a session on it failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if ran == provider:
        return None
    reasons = re.findall(r"with error: (.+)", log.getvalue()) + re.findall(r"(Require .+?)\.\s+Please", log.getvalue())
    why = "; ".join(dict.fromkeys(r.strip() for r in reasons)) or "`autotune doctor` shows why"
    return f"listed by this onnxruntime build, but a session asked for it ran on {ran} ({why})"


def _one_node_graph() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


@contextlib.contextmanager
def _captured_log() -> Iterator[io.StringIO]:
    """What ONNX Runtime writes while the block runs (its C++ log on file descriptor 2, its
    Python fallback notice on ``sys.stdout``), kept out of the user's terminal and given back."""
    text = io.StringIO()
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as log:
            os.dup2(log.fileno(), 2)
            try:
                with contextlib.redirect_stdout(text):
                    yield text
            finally:
                os.dup2(saved, 2)
                log.seek(0)
                text.write(re.sub(r"\x1b\[[0-9;]*m", "", log.read().decode(errors="replace")))
    finally:
        os.close(saved)


# ONNX tensor type names (InferenceSession.get_inputs()[i].type) to numpy dtypes.
_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def _torch_dtype(np_type: Any) -> torch.dtype:
    return torch.from_numpy(np.empty(0, np_type)).dtype


class OrtModule(nn.Module):
    """An ONNX file run by ONNX Runtime, called like the model it was exported from.

    Torch tensors in (positionally in ``input_names`` order, or by keyword), torch tensors out on
    the inputs' device: one tensor for a one-output graph, else a tuple. The session is created
    on first call and dropped when pickled, so the module pickles as its path and settings.

    Args:
        path: The ``.onnx`` file.
        input_names: Graph input names, in the model's argument order.
        output_names: Graph output names.
        provider: ONNX Runtime execution provider (``"CPUExecutionProvider"``,
            ``"CUDAExecutionProvider"``); CPU runs whatever the provider cannot.
        graph_optimization: ``"disable"``, ``"basic"``, ``"extended"`` or ``"all"``.
        intra_op_threads: Threads per operator; 0 lets ONNX Runtime choose.
        io_binding: Bind the torch tensors' memory as inputs and take the outputs as torch
            tensors (DLPack), with no copies: on CUDA, no host round trip.

    Example:
        >>> runner = OrtModule("model.onnx", ["input_0"], ["output"])  # doctest: +SKIP
        >>> runner(torch.randn(8, 1, 8, 8)).shape  # doctest: +SKIP
        torch.Size([8, 10])
    """

    def __init__(
        self,
        path: str | os.PathLike,
        input_names: list[str],
        output_names: list[str],
        *,
        provider: str = "CPUExecutionProvider",
        graph_optimization: str = "all",
        intra_op_threads: int = 0,
        io_binding: bool = False,
    ) -> None:
        super().__init__()
        if graph_optimization not in GRAPH_OPTIMIZATIONS:
            raise ConfigError(
                f"No graph optimization level {graph_optimization!r}. Known: {', '.join(GRAPH_OPTIMIZATIONS)}."
            )
        if intra_op_threads < 0:
            raise ConfigError(
                f"`intra_op_threads` must be >= 0 (0: ONNX Runtime's choice), but got {intra_op_threads}."
            )
        self.path = str(path)
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.provider = provider
        self.graph_optimization = graph_optimization
        self.intra_op_threads = intra_op_threads
        self.io_binding = io_binding
        # Set by the profiler (autotune.trial.profile): the next session records its nodes there.
        self.profile_prefix: str | None = None
        self._session: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_session": None}  # a session does not pickle; it is rebuilt

    @property
    def session(self) -> Any:
        """The ``onnxruntime.InferenceSession``, created on first use."""
        if self._session is None:
            import onnxruntime as ort

            available = ort.get_available_providers()
            if self.provider not in available:
                raise ConfigError(
                    f"ONNX Runtime has no provider {self.provider!r} here. Available: {', '.join(available)}."
                )
            options = ort.SessionOptions()
            options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[self.graph_optimization])
            options.intra_op_num_threads = self.intra_op_threads
            if getattr(self, "profile_prefix", None):
                options.enable_profiling = True
                options.profile_file_prefix = self.profile_prefix
            providers = list(dict.fromkeys([self.provider, "CPUExecutionProvider"]))
            self._session = ort.InferenceSession(self.path, options, providers=providers)
        return self._session

    @property
    def provider_ran(self) -> str:
        """The provider the session really runs on: :attr:`provider`, or the CPU's where ONNX
        Runtime could not load it (it falls back without raising)."""
        return self.session.get_providers()[0]

    def _feeds(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        if len(args) > len(self.input_names):
            raise InputError(
                f"The graph takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), but got {len(args)} positional."
            )
        feeds = dict(zip(self.input_names, args, strict=False))  # fewer args than names: rest by keyword
        for name, value in kwargs.items():
            if name not in self.input_names or name in feeds:
                raise InputError(f"Unexpected or repeated input {name!r}. Known: {', '.join(self.input_names)}.")
            feeds[name] = value
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise InputError(f"Missing graph inputs: {', '.join(missing)}.")
        return feeds

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        feeds = self._feeds(args, kwargs)
        device = next(iter(feeds.values())).device
        types = {i.name: _NP_TYPES.get(i.type) for i in self.session.get_inputs()}
        if self.io_binding and device.type in ("cpu", "cuda"):
            outs = self._run_bound(feeds, types, device)
        else:
            arrays = {n: _to_numpy(t, types[n]) for n, t in feeds.items() if n in types}
            outs = [torch.from_numpy(a).to(device) for a in self.session.run(None, arrays)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _run_bound(
        self, feeds: dict[str, torch.Tensor], types: dict[str, Any], device: torch.device
    ) -> list[torch.Tensor]:
        binding = self.session.io_binding()
        kind, index = device.type, device.index or 0
        if kind == "cuda" and device.index is None:
            index = torch.cuda.current_device()
        kept = []  # the bound tensors must outlive the run
        for name, tensor in feeds.items():
            if name not in types:
                continue
            if types[name] is not None:
                tensor = tensor.to(_torch_dtype(types[name]))
            tensor = tensor.contiguous()
            kept.append(tensor)
            binding.bind_input(name, kind, index, types[name] or np.float32, tuple(tensor.shape), tensor.data_ptr())
        for out in self.session.get_outputs():
            binding.bind_output(out.name, kind, index)
        if kind == "cuda":  # ONNX Runtime reads the inputs on its own stream: torch's writes must land first
            torch.cuda.current_stream(device).synchronize()
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return [torch.from_dlpack(value) for value in binding.get_outputs()]


def _to_numpy(tensor: torch.Tensor, np_type: Any) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.float()
    array = tensor.detach().cpu().numpy()
    return array.astype(np_type, copy=False) if np_type is not None else array
