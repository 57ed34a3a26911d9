"""OpenVINO artifacts of a torch model: conversion to an ``openvino.Model`` (a TorchScript trace
through ``openvino.convert_model``, or the ONNX export where that fails), static int8 by NNCF,
the IR files (``model.xml`` + ``model.bin``), and :class:`OvModule`, which runs one like the
model it came from, torch tensors in and out.

Inputs are named as the ONNX export names them (positional ``input_0, ...``, keyword inputs by
keyword) and keep a dynamic batch axis; token sequences keep a dynamic length, images whose size
varies (``spatial``) a dynamic height and width, so trimmed padding runs without a reshape.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from autotune.errors import ExportError, InputError
from autotune.export.ov_cache import CACHE_ENV, IrCache, float_cache, int8_cache, save_openvino  # noqa: F401
from autotune.export.ov_run import OvRunner
from autotune.export.parity import describe_error, exportable, flat_inputs, quiet_warnings
from autotune.export.stored import output_type
from autotune.samples import batch_size_of, pad_batch

__all__ = [
    "OvModule",
    "calibration_feeds",
    "convert_openvino",
    "is_transformer",
    "quantize_openvino",
    "save_openvino",
]


def _dynamic_dims(names: list[str], inputs: list[torch.Tensor], spatial: bool) -> list[list[bool]]:
    """Per input, which axes stay dynamic: the batch; the length of token sequences (the width of
    the ``attention_mask``, else of the first 2-D integer input) on every input that has it as
    its second axis; height and width of 4-D float inputs with ``spatial``."""
    width = next((int(t.shape[1]) for n, t in zip(names, inputs, strict=True) if n == "attention_mask"), None)
    if width is None:
        width = next((int(t.shape[1]) for t in inputs if t.dim() == 2 and not t.is_floating_point()), None)
    dims = []
    for t in inputs:
        flags = [i == 0 for i in range(t.dim())]
        if width is not None and t.dim() >= 2 and int(t.shape[1]) == width and not (t.dim() == 4 and spatial):
            flags[1] = True
        if spatial and t.dim() == 4 and t.is_floating_point():
            flags[2] = flags[3] = True
        dims.append(flags)
    return dims


def _name_ports(
    model: Any, names: list[str], output_names: list[str], inputs: list[torch.Tensor], spatial: bool
) -> Any:
    """``model`` with its inputs and outputs named, and every axis but the dynamic ones fixed to
    the example's size (static shapes compile to faster kernels)."""
    import openvino as ov

    if len(model.inputs) != len(names) or len(model.outputs) != len(output_names):
        raise ExportError(
            f"The converted model has {len(model.inputs)} inputs and {len(model.outputs)} outputs, but the model "
            f"takes {len(names)} and gives {len(output_names)}."
        )
    for port, name in zip(model.inputs, names, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, output_names, strict=True):
        port.get_tensor().set_names({name})
    shapes = {}
    for name, t, flags in zip(names, inputs, _dynamic_dims(names, inputs, spatial), strict=True):
        shapes[name] = ov.PartialShape([-1 if dynamic else int(n) for n, dynamic in zip(t.shape, flags, strict=True)])
    model.reshape(shapes)
    return model


def _trace(flat: nn.Module, inputs: list[torch.Tensor]) -> Any:
    """``flat`` through a TorchScript trace into ``openvino.convert_model``. The trace is made
    here, without torch's check (which re-traces and compares the graphs, and fails on a module
    class defined twice under one name)."""
    import openvino as ov

    with torch.no_grad(), quiet_warnings():
        traced = torch.jit.trace(flat, tuple(inputs), check_trace=False, strict=False)
        return ov.convert_model(traced, example_input=tuple(inputs))


_GENERATED = re.compile(r"^[A-Za-z]+_\d+$")


def _stable_names(model: Any) -> Any:
    """``model`` with each op OpenVINO named from a process-wide counter (``Multiply_26202``)
    renamed by its place in the graph, so a conversion in another process, or a later one in
    this process, names it alike: the layers a ranking keeps float are named, and a ResNet's
    folded convolutions (``Multiply_4706`` in one conversion, ``Multiply_26202`` in the next)
    failed the confirmation's rebuild ("the ranking is for another model")."""
    for i, op in enumerate(model.get_ordered_ops()):
        if _GENERATED.match(op.get_friendly_name()):
            op.set_friendly_name(f"{op.get_type_name()}#{i}")
    return model


def convert_openvino(
    model: nn.Module, example: Any, *, spatial: bool = False, onnx_path: Path | None = None
) -> tuple[Any, dict[str, Any]]:
    """``model`` as an ``openvino.Model`` with dynamic batch (and sequence or image size) axes.

    ``openvino.convert_model`` runs on a TorchScript trace of the model first; where that
    fails, the model is exported to ONNX (:func:`autotune.export.onnx.export_onnx`, at
    ``onnx_path``) and that file converted.

    Args:
        model: The model, in eval mode on the CPU; ``torch.compile`` wrappers are removed first.
        example: One collated batch on the CPU (a batch of 1 is repeated to 2).
        spatial: Images of many sizes: 4-D float inputs take any height and width.
        onnx_path: Where the ONNX fallback writes its file (default: no fallback).

    Returns:
        ``(ov_model, info)``, ``info`` with ``input_names``, ``output_names``, ``converted_from``
        (``"torch"`` or ``"onnx"``) and ``fallback_reason`` (the trace's error, when it failed).

    Raises:
        ExportError: neither path converted the model; the message gives each one's cause.
    """
    from autotune.export.onnx import _Flat, _output_names

    model = exportable(model)
    if batch_size_of(example) < 2:
        example = pad_batch(example, 2)
    names, inputs, n_args = flat_inputs(example)
    with torch.no_grad():
        out = model(*inputs[:n_args], **dict(zip(names[n_args:], inputs[n_args:], strict=True)))
    output_names = _output_names(out)
    info: dict[str, Any] = {"input_names": names, "output_names": output_names, "fallback_reason": None}
    info["output_type"] = output_type(out)  # a ModelOutput's class, given back by autotune.export.keyed
    try:
        converted = _name_ports(
            _trace(_Flat(model, n_args, names[n_args:]), inputs), names, output_names, inputs, spatial
        )
        return _stable_names(converted), {**info, "converted_from": "torch"}
    except Exception as exc:  # a trace OpenVINO cannot take: the ONNX export may convert
        reason = describe_error(exc)
        if onnx_path is None:
            raise ExportError(f"OpenVINO could not convert {type(model).__name__}: {reason}") from exc
    import openvino as ov

    from autotune.export.onnx import export_onnx

    try:
        onnx_info = export_onnx(model, example, Path(onnx_path), spatial=spatial)
        converted = ov.convert_model(str(onnx_path))
    except Exception as exc:
        raise ExportError(
            f"OpenVINO could not convert {type(model).__name__}: from a trace: {reason}; from ONNX: {describe_error(exc)}"
        ) from exc
    info.update(input_names=onnx_info["input_names"], output_names=onnx_info["output_names"])
    return _stable_names(converted), {**info, "converted_from": "onnx", "fallback_reason": reason}


def is_transformer(model: Any) -> bool:
    """Whether an ``openvino.Model`` holds attention: a Softmax and a MatMul of two computed
    tensors, or OpenVINO's fused attention op. NNCF then quantizes it as a transformer."""
    types = {op.get_type_name() for op in model.get_ordered_ops()}
    if "ScaledDotProductAttention" in types:
        return True
    if "Softmax" not in types:
        return False
    return any(
        op.get_type_name() == "MatMul"
        and all(op.input_value(i).get_node().get_type_name() != "Constant" for i in range(2))
        for op in model.get_ordered_ops()
    )


def calibration_feeds(batches: Sequence[Any], names: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """Collated batches as OpenVINO feeds: each batch's model inputs by input name, as numpy.

    Raises:
        InputError: a batch's inputs do not match ``names``.
    """
    feeds = []
    for i, batch in enumerate(batches):
        got, tensors, _ = flat_inputs(batch)
        if list(got) != list(names):
            raise InputError(f"Calibration batch {i} has the inputs {got}, but the model takes {list(names)}.")
        feeds.append({n: _to_numpy(t) for n, t in zip(names, tensors, strict=True)})
    return feeds


@contextlib.contextmanager
def _quiet_nncf() -> Iterator[None]:
    """NNCF's progress bars and info lines (printed on every call) kept out of the user's terminal."""
    import nncf

    logger = logging.getLogger("nncf")
    level = logger.level
    nncf.set_log_level(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), quiet_warnings():
            yield
    finally:
        logger.setLevel(level)


def quantize_openvino(
    model: Any, feeds: Sequence[dict[str, np.ndarray]], *, ignored: Sequence[str] = (), transformer: bool | None = None
) -> Any:
    """``model`` in static int8 by ``nncf.quantize``, calibrated on ``feeds``: activations and
    weights of every layer NNCF takes but those named in ``ignored`` (OpenVINO op names), which
    stay float. ``model`` itself is not changed.

    Args:
        model: A float ``openvino.Model``.
        feeds: Calibration batches (:func:`calibration_feeds`); every one is used.
        ignored: Op names NNCF leaves float (its ``IgnoredScope``).
        transformer: NNCF's transformer scheme (``ModelType.TRANSFORMER``: SmoothQuant, attention
            patterns); default: :func:`is_transformer`.

    Raises:
        InputError: no calibration batches.
        ExportError: NNCF failed.
    """
    import nncf

    if not feeds:
        raise InputError("OpenVINO static int8 needs calibration batches to observe activation ranges, but got none.")
    transformer = is_transformer(model) if transformer is None else transformer
    scope = nncf.IgnoredScope(names=list(ignored), validate=False) if ignored else None
    try:
        with _quiet_nncf():
            return nncf.quantize(
                model.clone(),
                nncf.Dataset(list(feeds)),
                subset_size=len(feeds),
                model_type=nncf.ModelType.TRANSFORMER if transformer else None,
                ignored_scope=scope,
            )
    except Exception as exc:
        raise ExportError(f"NNCF could not quantize the OpenVINO model: {describe_error(exc)}") from exc


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.float()
    return tensor.detach().cpu().numpy()


class OvModule(nn.Module):
    """An OpenVINO model (an IR file, or in memory) on the CPU, called like the model it came
    from: torch tensors in (positionally in ``input_names`` order, or by keyword), torch tensors
    out on the inputs' device, one tensor for a one-output model, else a tuple.

    Args:
        model: ``model.xml`` or an ``openvino.Model``.
        input_names, output_names: The model's inputs (positional order) and outputs.
        precision, hint, threads: As :class:`~autotune.export.ov_run.OvRunner` takes them.

    Example:
        >>> runner = OvModule("model.xml", ["input_0"], ["output"])  # doctest: +SKIP
        >>> runner(torch.randn(8, 4)).shape  # doctest: +SKIP
        torch.Size([8, 2])
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
        super().__init__()
        self.runner = OvRunner(model, input_names, output_names, precision=precision, hint=hint, threads=threads)
        self.input_names = list(input_names)
        self.output_names = list(output_names)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tensors = [*args, *kwargs.values()]
        device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))
        outs = self.runner.run(
            [_to_numpy(a) if isinstance(a, torch.Tensor) else a for a in args],
            {k: _to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
        )
        result = [torch.from_numpy(o).to(device) for o in outs]
        return result[0] if len(result) == 1 else tuple(result)
