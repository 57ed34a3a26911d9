"""INT8 quantization: dynamic, weight-only and static (PT2E), and the size a model ships at.

CPU ``int8_dynamic`` is PyTorch's dynamic quantization of Linear/LSTM/GRU. CPU ``int8_static`` is
PT2E with the X86 Inductor quantizer: eagerly its graph runs quantize/dequantize ops around float
kernels (slower than float32); int8 kernels replace them under ``torch.compile`` with frozen
weights (``torch._inductor.config.freezing`` set while Dynamo traces) and static shapes.
``int8_weight_only`` is torchao's ``quantize_`` (slower than float32 on CPU: searched there for
size only), as is ``int8_dynamic`` on CUDA. Each method can leave named layers float
(``keep_float``), which the ``int8_fallback`` knob does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import operator
import platform
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, overload

import torch
from torch import nn

from autotune.compress._quiet import quiet_torchao
from autotune.errors import ConfigError, TrialError
from autotune.samples import map_tensors, model_inputs

__all__ = ["METHODS", "offered", "quantize", "serialized_bytes"]

METHODS = ("none", "int8_dynamic", "int8_weight_only", "int8_static")

_CPU_WEIGHT_ONLY = (
    "torchao's int8 weight-only Linear is slower than float32 on CPU (measured 1.2-4x, eager or compiled): "
    "offered there when size or memory is an objective"
)
_SHRINK_OBJECTIVES = frozenset({"size", "memory"})
_CUDA_STATIC = (
    "PT2E static int8 lowers to oneDNN kernels for x86 CPUs only; on CUDA, torchao offers "
    "int8_dynamic and int8_weight_only"
)
_X86 = ("x86_64", "amd64", "i386", "i686")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"No quantization method named {method!r}. Known: {', '.join(METHODS)}.")


def _torchao_missing() -> str | None:
    # find_spec, not import: importing torchao takes seconds and logs about optional kernels.
    if importlib.util.find_spec("torchao") is None:
        return "needs torchao, which is not installed (pip install 'torchao>=0.12')"
    return None


def offered(method: str, env: Any, objectives: Iterable[str] = ()) -> str | None:
    """Whether ``method`` is worth searching on ``env``.

    On CPU: ``int8_dynamic`` and, on x86, ``int8_static``; ``int8_weight_only``, slower than
    float32 there, only when size or memory is among ``objectives`` (it keeps activations float,
    so it can hold accuracy where the others do not). On CUDA: ``int8_dynamic`` and
    ``int8_weight_only`` (torchao).

    Args:
        method: One of :data:`METHODS`.
        env: The :class:`~autotune.env.Env` trials run on.
        objectives: The search's objectives.

    Returns:
        ``None`` when the method is offered, else the one-line reason it is not.

    Raises:
        ConfigError: ``method`` is not one of :data:`METHODS`.

    Example:
        >>> from autotune.env import Env
        >>> offered("int8_dynamic", Env.detect("cpu")) is None
        True
    """
    _check_method(method)
    if method == "int8_weight_only" and not env.is_cuda and not _SHRINK_OBJECTIVES & set(objectives):
        return _CPU_WEIGHT_ONLY
    return _not_offered(method, env.is_cuda)


def _not_offered(method: str, on_cuda: bool) -> str | None:
    """Why ``method`` cannot run on the device, or ``None``."""
    if method == "none":
        return None
    if on_cuda:
        return _CUDA_STATIC if method == "int8_static" else _torchao_missing()
    if method == "int8_weight_only":
        return _torchao_missing()
    if method == "int8_dynamic":
        if torch.backends.quantized.supported_engines == ["none"]:
            return "this torch build has no quantized CPU engine (fbgemm, onednn or qnnpack)"
        return None
    if platform.machine().lower() not in _X86:
        return f"the X86 Inductor quantizer needs an x86 CPU, but this one is {platform.machine()}"
    return _torchao_missing()


def quantize(
    model: nn.Module,
    method: str,
    device: str,
    calibration: list,
    *,
    example: Any,
    layers: Iterable[str] | None = None,
    keep_float: Iterable[str] = (),
    per_channel: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """Quantize ``model`` to int8 with ``method`` for ``device``.

    The model may be changed in place; use the module returned.

    Args:
        model: The float model, in eval mode, on ``device``.
        method: One of :data:`METHODS`.
        device: ``"cpu"`` or ``"cuda:N"``.
        calibration: Collated batches on the CPU; ``int8_static`` observes activations on them.
        example: One collated batch on the CPU; ``int8_static`` exports with it.
        layers: Module names to quantize (``nn.Linear``, and ``nn.Conv2d`` for ``int8_static``),
            the others staying float; ``None`` quantizes every layer the method takes.
        keep_float: Module names left float (with all they hold) where every other layer is
            quantized as without them.
        per_channel: CPU ``int8_dynamic`` with one weight scale per output channel, not per
            tensor (the other methods always have per-channel weights).

    Returns:
        The model to run (for ``int8_static`` a new ``GraphModule`` that accepts any batch
        size) and ``{"method", "backend", "n_quantized"}``, the last the number of layers quantized.

    Raises:
        ConfigError: ``method`` is not one of :data:`METHODS`.
        TrialError: kind ``unsupported``: the method cannot run on ``device``, the model has
            nothing it quantizes, a layer in ``layers`` stayed float, or the library failed.

    Example:
        >>> q, info = quantize(nn.Sequential(nn.Linear(8, 4)), "int8_dynamic", "cpu", [], example=None)
        >>> info["n_quantized"]
        1
    """
    _check_method(method)
    if method == "none":
        return model, {"method": "none", "backend": None, "n_quantized": 0}
    on_cuda = device.startswith("cuda")
    reason = _not_offered(method, on_cuda)
    if reason is not None:
        raise TrialError("unsupported", f"{method} is not offered on {device}: {reason}.")
    names, keep = None if layers is None else set(layers), set(keep_float)
    if on_cuda or method == "int8_weight_only":
        model, backend, n = _torchao_(model, method, names, keep)
    elif method == "int8_dynamic":
        model, backend, n = _dynamic_cpu(model, names, keep, per_channel)
    else:
        model, backend, n = _static_cpu(model, calibration, example, names, keep)
    if names is not None and n != len(names):
        raise TrialError("unsupported", f"{method} quantized {n} of the {len(names)} layers it was given.")
    if example is not None:
        _probe(model, example, device, method)
    return model, {"method": method, "backend": backend, "n_quantized": n}


def _probe(model: nn.Module, example: Any, device: str, method: str) -> None:
    """Run the quantized model once: some modules quantize without error and then fail in their
    forward pass (a TransformerEncoderLayer's fused path on dynamically quantized weights), and
    that is a property of the method on this model, not a fault of the trial."""
    from autotune.samples import model_inputs, to_device

    args, kwargs = model_inputs(to_device(example, torch.device(device)))
    try:
        with torch.inference_mode():
            model(*args, **kwargs)
    except Exception as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        raise TrialError("unsupported", f"the {method} model fails to run: {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _library_errors(what: str) -> Iterator[None]:
    """Turn a library failure into ``TrialError("unsupported")``; out-of-memory stays itself."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as exc:
        text = " ".join(str(exc).split())
        text = text[:300] + "..." if len(text) > 300 else text
        raise TrialError("unsupported", f"{what} failed: {type(exc).__name__}: {text}") from exc


def _dynamic_cpu(
    model: nn.Module, names: set[str] | None, keep: set[str], per_channel: bool
) -> tuple[nn.Module, str, int]:
    from torch.ao.nn.quantized import dynamic as nnqd
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    linear = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    if names is None:
        spec: dict[Any, Any] = {nn.Linear: linear, nn.LSTM: default_dynamic_qconfig, nn.GRU: default_dynamic_qconfig}
    else:
        spec = {
            name: linear if type(model.get_submodule(name)) is nn.Linear else default_dynamic_qconfig for name in names
        }
    spec.update(dict.fromkeys(keep, None))  # a name's qconfig wins over its type's: None stays float

    with warnings.catch_warnings(), _library_errors("Dynamic quantization (torch.ao.quantization)"):
        # torch.ao.quantization is deprecated in favour of torchao, whose CPU int8 Linear is
        # slower eagerly; the old path stays the fast one, so its warnings are noise here.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        model = torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)
    n = sum(isinstance(m, (nnqd.Linear, nnqd.LSTM, nnqd.GRU)) for m in model.modules())
    if n == 0:
        raise TrialError("unsupported", "int8_dynamic found no nn.Linear, nn.LSTM or nn.GRU layer to quantize.")
    if any(isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) for m in model.modules()):
        # Their fused fast path reads float weights that quantized Linears do not have.
        model = WithoutFastPath(model)
    return model, torch.backends.quantized.engine, n


class WithoutFastPath(nn.Module):
    """Runs a model with PyTorch's fused transformer fast path off, which only takes float weights."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        enabled = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            return self.model(*args, **kwargs)
        finally:
            torch.backends.mha.set_fastpath_enabled(enabled)


def _torchao_(model: nn.Module, method: str, names: set[str] | None, keep: set[str]) -> tuple[nn.Module, str, int]:
    with quiet_torchao():  # its import-time messages are noise here
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
        from torchao.quantization.quant_api import _is_linear

    # set_inductor_config=False: torchao would otherwise tune inductor process-wide, changing how
    # every later candidate (the baseline included) compiles.
    config = (
        Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
        if method == "int8_dynamic"
        else Int8WeightOnlyConfig(set_inductor_config=False)
    )

    def chosen(module: nn.Module, fqn: str) -> bool:
        # torchao's own choice (Linear, not attention's out_proj), or the names asked for
        taken = _is_linear(module) if names is None else type(module) is nn.Linear and fqn in names
        return taken and not any(fqn == k or fqn.startswith(k + ".") for k in keep)

    with _library_errors(f"torchao quantize_({type(config).__name__})"):
        quantize_(model, config, filter_fn=chosen)
    # A quantized weight is a torchao tensor subclass; an untouched one is a plain Parameter.
    n = sum(type(m.weight) not in (torch.Tensor, nn.Parameter) for m in model.modules() if isinstance(m, nn.Linear))
    if n == 0:
        raise TrialError("unsupported", f"{method} found no nn.Linear layer to quantize.")
    return model, "torchao", n


def _batch_dynamic(obj: Any) -> Any:
    """The dynamic-shape spec of one argument: every tensor's dim 0 (the batch) left to export,
    and an integer ``(batch, seq)`` tensor's dim 1 too (token ids and masks: trimmed padding and
    natural-length batches change it every batch; a graph exported at one width failed its guard
    at the next)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 2 and not obj.is_floating_point():
            return {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
        return {0: torch.export.Dim.AUTO} if obj.dim() > 0 else None
    if isinstance(obj, Mapping):
        return {k: _batch_dynamic(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_batch_dynamic(v) for v in obj)
    return None


def _export(model: nn.Module, example: Any) -> Any:
    args, kwargs = model_inputs(example)
    first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is not None and first.shape[0] < 2:
        # export specializes a size-1 dimension to the constant 1; two samples keep it dynamic.
        args, kwargs = model_inputs(map_tensors(lambda t: torch.cat([t, t]) if t.dim() else t, example))
    with _library_errors("torch.export"):
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        shapes = {name: _batch_dynamic(value) for name, value in bound.items()}
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False).module()


def _static_cpu(
    model: nn.Module, calibration: list, example: Any, names: set[str] | None, keep: set[str]
) -> tuple[nn.Module, str, int]:
    with quiet_torchao():  # its import-time messages are noise here
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
        from torchao.quantization.pt2e import allow_exported_model_train_eval
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    graph = _export(model.eval(), example)
    config = xiq.get_default_x86_inductor_quantization_config()
    quantizer = xiq.X86InductorQuantizer()
    if names is None:
        quantizer.set_global(config)
    else:  # only these modules: the rest of the graph, float ops between them included, stays float
        for name in sorted(names):
            quantizer.set_module_name_qconfig(name, config)
    for name in sorted(keep):  # a module's config wins over the global one: None stays float
        quantizer.set_module_name_qconfig(name, None)
    with _library_errors("PT2E quantization (X86InductorQuantizer)"), torch.no_grad():
        prepared = prepare_pt2e(graph, quantizer)
        for batch in calibration or [example]:
            args, kwargs = model_inputs(batch)
            prepared(*args, **kwargs)
        converted = convert_pt2e(prepared)
    _drop_unused_(converted)
    # Exported graphs refuse .eval(), which wrappers call on their children; this maps it onto
    # the graph's own eval switch (dropout, batch norm).
    allow_exported_model_train_eval(converted)
    # convert_pt2e folds each quantized weight into an int8 constant read by a get_attr node.
    n = sum(operator.attrgetter(node.target)(converted).dtype == torch.int8 for node in _get_attrs(converted))
    if n == 0:
        raise TrialError("unsupported", "int8_static found no convolution or linear op the X86 quantizer quantizes.")
    return converted, "x86_inductor", n


def _get_attrs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(operator.attrgetter(n.target)(gm), torch.Tensor)
    ]


def _dead_names(graph_module: torch.fx.GraphModule) -> set[str]:
    """State-dict keys of ``graph_module`` its graph never reads (the float weights PT2E replaced)."""
    live = {n.target for n in graph_module.graph.nodes if n.op in ("get_attr", "call_module")}
    dead = set()
    for key in graph_module.state_dict():
        parts = key.split(".")
        # Read itself, or as part of a module the graph calls or reads whole.
        if not any(".".join(parts[:i]) in live for i in range(1, len(parts) + 1)):
            dead.add(key)
    return dead


def _drop_unused_(graph_module: torch.fx.GraphModule) -> None:
    # The float weights stay attached after convert_pt2e; dropping them frees their memory.
    for key in _dead_names(graph_module):
        owner, _, name = key.rpartition(".")
        module = graph_module.get_submodule(owner)
        module._parameters.pop(name, None)
        module._buffers.pop(name, None)


@overload
def serialized_bytes(model: nn.Module, *, raw: Literal[False] = False) -> int: ...
@overload
def serialized_bytes(model: nn.Module, *, raw: Literal[True]) -> bytes: ...
def serialized_bytes(model: nn.Module, *, raw: bool = False) -> int | bytes:
    """Bytes of ``torch.save(model.state_dict())`` as a deployment would ship it.

    Int8 weights count as stored: packed params of dynamic-quantized modules, torchao tensor
    subclasses, and the int8 constants of PT2E ``GraphModule``s, whose float weights the graph
    no longer reads are left out. ``torch.compile`` wrappers are looked through.

    Args:
        model: Any module, quantized or not.
        raw: Return the serialized bytes themselves (to compress them, say), not their count.

    Example:
        >>> serialized_bytes(nn.Linear(256, 256)) > 256 * 256 * 4
        True
    """
    model = getattr(model, "_orig_mod", model)
    state = model.state_dict()
    for prefix, sub in model.named_modules():
        if isinstance(sub, torch.fx.GraphModule):
            dot = f"{prefix}." if prefix else ""
            for key in _dead_names(sub):
                state.pop(dot + key, None)
            # A get_attr may read a tensor that is a plain attribute, not a registered buffer.
            for node in _get_attrs(sub):
                state.setdefault(dot + node.target, operator.attrgetter(node.target)(sub))
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue() if raw else buf.tell()
