"""ONNX artifacts: export (dynamo exporter first, TorchScript exporter as fallback), onnxslim
simplification, INT8 and float16 variants. :class:`~autotune.export.ort.OrtModule`, which runs
one like the model, lives in :mod:`autotune.export.ort` and is re-exported here.

Graph inputs are named after the batch's structure: positional inputs ``input_0, input_1, ...``,
keyword inputs by their keyword. Every input and output has a dynamic first (batch) axis.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from autotune.errors import ConfigError, ExportError, InputError
from autotune.export.ort import _NP_TYPES, GRAPH_OPTIMIZATIONS, OrtModule  # noqa: F401 (their former home)
from autotune.export.parity import describe_error, device_of, exportable, flat_inputs, output_leaves, quiet_warnings
from autotune.export.stored import output_type
from autotune.samples import batch_size_of, pad_batch

__all__ = ["GRAPH_OPTIMIZATIONS", "QUANT_METHODS", "OrtModule", "export_onnx", "quantize_onnx", "to_fp16"]

QUANT_METHODS = ("int8_dynamic", "int8_static")
_MIN_OPSET = 17
_SIMPLIFY_RTOL = 1e-4


class _Flat(nn.Module):
    """The model behind a flat signature: positional tensors in, a tuple of tensors out, as an
    ONNX graph has them."""

    def __init__(self, model: nn.Module, n_args: int, keys: list[str]) -> None:
        super().__init__()
        self.model = model
        self.n_args = n_args
        self.keys = keys

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(*flat[: self.n_args], **dict(zip(self.keys, flat[self.n_args :], strict=True)))
        return tuple(output_leaves(out))


def _output_names(out: Any) -> list[str]:
    if isinstance(out, torch.Tensor):
        return ["output"]
    if isinstance(out, Mapping) and all(isinstance(v, torch.Tensor) for v in out.values()):
        return [str(k) for k in out]
    return [f"output_{i}" for i in range(len(output_leaves(out)))]


def _seq_width(names: list[str], inputs: list[torch.Tensor]) -> int | None:
    """The sequence width of a batch of token sequences (its 2-D ``attention_mask``), or ``None``."""
    for name, t in zip(names, inputs, strict=True):
        if name == "attention_mask" and t.dim() == 2:
            return int(t.shape[1])
    return None


def _export(
    flat: _Flat, inputs: list[torch.Tensor], path: Path, opset: int, names: tuple, *, dynamo: bool, spatial: bool
) -> None:
    # Token sequences: every (batch, seq, ...) input gets a dynamic sequence axis as well, so the
    # graph takes any length (trimmed padding makes every batch's length its own).
    width = _seq_width(names[0], inputs)

    def seq(t: torch.Tensor) -> bool:
        return width is not None and t.dim() >= 2 and t.shape[1] == width

    def image(t: torch.Tensor) -> bool:  # (batch, channels, height, width) of images whose size varies
        return spatial and t.dim() == 4 and t.is_floating_point()

    if dynamo:
        batch, length = torch.export.Dim("batch"), torch.export.Dim("seq")
        # AUTO: the exporter finds what the model needs of a height and width (a multiple of a
        # stride, say) instead of refusing a free one.
        side = torch.export.Dim.AUTO

        def dims(t: torch.Tensor) -> Any:
            if t.dim() == 0:  # a 0-d input has no batch axis
                return None
            return {0: batch, 1: length} if seq(t) else {0: batch, 2: side, 3: side} if image(t) else {0: batch}

        # One entry: the tuple of tensors behind `*flat`.
        axes: dict[str, Any] = {"dynamic_shapes": (tuple(dims(t) for t in inputs),)}
    else:
        dyn = {
            n: {0: "batch", 1: "seq"} if seq(t) else {0: "batch", 2: "height", 3: "width"} if image(t) else {0: "batch"}
            for n, t in zip(names[0], inputs, strict=True)
        }
        axes = {"dynamic_axes": {**dyn, **{name: {0: "batch"} for name in names[1]}}}
    with quiet_warnings():
        program = torch.onnx.export(
            flat,
            tuple(inputs),
            None if dynamo else str(path),
            dynamo=dynamo,
            opset_version=opset,
            input_names=names[0],
            output_names=names[1],
            verbose=False,
            **axes,
        )
        if dynamo:
            program.save(str(path))


def _export_either(
    flat: _Flat, inputs: list[torch.Tensor], path: Path, opset: int, names: tuple, spatial: bool = False
) -> tuple[str, str | None]:
    """Export with the dynamo exporter, else the TorchScript one: (exporter, dynamo's error)."""
    try:
        _export(flat, inputs, path, opset, names, dynamo=True, spatial=spatial)
        return "dynamo", None
    except Exception as exc:  # torch.export refuses many models; the older exporter may not
        reason = describe_error(exc)
    try:
        _export(flat, inputs, path, opset, names, dynamo=False, spatial=spatial)
    except Exception as exc:
        path.unlink(missing_ok=True)
        raise ExportError(
            f"Neither ONNX exporter could export {type(flat.model).__name__}: dynamo: {reason}; "
            f"torchscript: {describe_error(exc)}"
        ) from exc
    return "torchscript", reason


def export_onnx(
    model: nn.Module, example: Any, path: Path, *, opset: int = 18, spatial: bool = False
) -> dict[str, Any]:
    """Export ``model`` to an ONNX file with a dynamic batch axis (and, for token sequences with
    an ``attention_mask``, a dynamic sequence axis; with ``spatial``, dynamic height and width
    axes for 4-D float inputs, images whose size varies), simplified with onnxslim.

    The dynamo-based exporter (``torch.export``) runs first; the TorchScript-based one is the
    fallback. The onnxslim-simplified graph is kept only if it gives the unsimplified graph's
    outputs on ``example`` (within 1e-4 relative).

    Args:
        model: The model, in eval mode; ``torch.compile`` wrappers are removed first.
        example: One collated batch on the model's device (a batch of 1 is repeated to 2, since
            ``torch.export`` would fix a size-1 axis).
        path: The ``.onnx`` file to write.
        opset: The ONNX opset, at least 17.
        spatial: Images of many sizes: 4-D float inputs take any height and width.

    Returns:
        ``{"path", "opset", "exporter", "fallback_reason", "simplified", "input_names",
        "output_names"}``; ``exporter`` is ``"dynamo"`` or ``"torchscript"`` and
        ``fallback_reason`` the dynamo exporter's error when it failed.

    Raises:
        ConfigError: ``opset`` is below 17.
        ExportError: both exporters failed; the message gives each one's cause.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp()) / "m.onnx"
        >>> export_onnx(nn.Linear(4, 2).eval(), torch.randn(2, 4), out)["input_names"]  # doctest: +SKIP
        ['input_0']
    """
    if opset < _MIN_OPSET:
        raise ConfigError(f"`opset` must be at least {_MIN_OPSET}, but got {opset}.")
    from autotune.export.onnx_cache import cached_export

    model, path = exportable(model), Path(path)
    # The same graph for a model on another device, at another batch size or thread count.
    salt = f"{opset}:{spatial}:{device_of(model).type}"
    return cached_export(model, example, salt, path, lambda: _export_onnx(model, example, path, opset, spatial))


def _export_onnx(model: nn.Module, example: Any, path: Path, opset: int, spatial: bool) -> dict[str, Any]:
    if batch_size_of(example) < 2:
        example = pad_batch(example, 2)
    names, inputs, n_args = flat_inputs(example)
    flat = _Flat(model, n_args, names[n_args:])
    with torch.no_grad():
        out = model(*inputs[:n_args], **dict(zip(names[n_args:], inputs[n_args:], strict=True)))
    output_names = _output_names(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = path.with_name(path.stem + ".raw.onnx")
    exporter, fallback_reason = _export_either(flat, inputs, raw, opset, (names, output_names), spatial)
    simplified = _simplify(raw, path, dict(zip(names, inputs, strict=True)), shapes_known=exporter == "dynamo")
    import onnx

    opsets = {o.domain: o.version for o in onnx.load(str(path), load_external_data=False).opset_import}
    return {
        "path": str(path),
        "opset": opsets.get("", opset),
        "exporter": exporter,
        "fallback_reason": fallback_reason,
        "simplified": simplified,
        "input_names": names,
        "output_names": output_names,
        "output_type": output_type(out),  # a ModelOutput's class, given back by autotune.export.keyed
    }


def _ort_outputs(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # tiny check runs; no thread pool worth starting
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _close(got: np.ndarray, expected: np.ndarray) -> bool:
    got, expected = got.astype(np.float64), expected.astype(np.float64)  # bool and int outputs too
    scale = float(np.abs(expected).max(initial=1.0))
    return got.shape == expected.shape and np.allclose(got, expected, rtol=_SIMPLIFY_RTOL, atol=_SIMPLIFY_RTOL * scale)


def _simplify(raw: Path, path: Path, inputs: dict[str, torch.Tensor], shapes_known: bool = False) -> bool:
    """Write ``raw`` simplified by onnxslim to ``path`` if outputs hold, else ``raw`` itself.

    ``shapes_known``: the graph carries its values' shapes already (the dynamo exporter writes
    them), so onnxslim does not infer them again: on real MiniLM its two passes over the 90-MB
    graph were 0.7 of its 1 s, for the same 309 nodes and the same outputs."""
    import onnx
    import onnxslim

    feeds = {k: v.detach().cpu().numpy() for k, v in inputs.items()}
    try:
        slim = onnxslim.slim(onnx.load(str(raw)), no_shape_infer=shapes_known)
        expected = _ort_outputs(str(raw), feeds)
        got = _ort_outputs(slim.SerializeToString(), feeds)
        same = len(got) == len(expected) and all(_close(g, e) for g, e in zip(got, expected, strict=True))
    except Exception:  # onnxslim is an optimization: the unsimplified graph is a valid artifact
        same = False
    if same:
        onnx.save(slim, str(path))
        raw.unlink()
    else:
        os.replace(raw, path)
    return same


def _untie_gemm_weights(model: Any) -> None:
    """Give every Gemm its own copy of a weight it shares with other nodes.

    ONNX Runtime's quantizer rewrites Gemm(transB=1) as MatMul by transposing the weight in
    place, once per Gemm: a weight two Gemms share (layers deep-copied from one, tied
    embeddings) ends up transposed twice, and the graph computes garbage.
    """
    import collections

    import onnx

    initializers = {t.name: t for t in model.graph.initializer}
    uses = collections.Counter(name for node in model.graph.node for name in node.input if name in initializers)
    for node in model.graph.node:
        if node.op_type == "Gemm" and len(node.input) > 1 and uses[node.input[1]] > 1:
            copy = onnx.TensorProto()
            copy.CopyFrom(initializers[node.input[1]])
            copy.name = f"{node.input[1]}__{node.output[0]}"
            model.graph.initializer.append(copy)
            uses[node.input[1]] -= 1
            node.input[1] = copy.name
    unused = [t for t in model.graph.initializer if t.name in uses and uses[t.name] == 0]
    for tensor in unused:
        model.graph.initializer.remove(tensor)


class _BatchReader:
    """Calibration batches as ONNX Runtime feeds (a ``CalibrationDataReader``)."""

    def __init__(self, batches: list, names: list[str]) -> None:
        feeds = []
        for batch in batches:
            _, tensors, _ = flat_inputs(batch)
            feeds.append({n: t.detach().cpu().numpy() for n, t in zip(names, tensors, strict=True)})
        self._feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def quantize_onnx(src: Path, dst: Path, method: str, calibration: list, *, per_channel: bool = False) -> dict[str, Any]:
    """Write an INT8 version of the ONNX file ``src`` to ``dst`` with ONNX Runtime's quantizer.

    ``"int8_dynamic"`` quantizes weights to int8 and activations at run time (MatMul-heavy
    models: transformers, MLPs, RNNs). ``"int8_static"`` inserts QuantizeLinear/DequantizeLinear
    pairs (QDQ format) with activation ranges calibrated on ``calibration`` and per-channel
    weights (convolutional models).

    Args:
        src: A float32 ONNX file, as :func:`export_onnx` writes.
        dst: The file to write.
        method: ``"int8_dynamic"`` or ``"int8_static"``.
        calibration: Collated batches (``int8_static`` only), structured like the export example.
        per_channel: ``int8_dynamic`` with one weight scale per output channel, not one per
            tensor (``int8_static`` always has them).

    Returns:
        ``{"path", "method", "quant_format", "per_channel", "bytes", "src_bytes"}``.

    Raises:
        ConfigError: unknown ``method``.
        InputError: ``int8_static`` without calibration batches.
        ExportError: the quantizer failed.
    """
    if method not in QUANT_METHODS:
        raise ConfigError(f"No ONNX quantization method named {method!r}. Known: {', '.join(QUANT_METHODS)}.")
    if method == "int8_static" and not calibration:
        raise InputError("`int8_static` needs calibration batches to observe activation ranges, but got none.")
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src))
    _untie_gemm_weights(model)
    prepared = dst.with_name(dst.stem + ".prep.onnx")
    onnx.save(model, str(prepared))
    names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    try:
        if method == "int8_dynamic":
            quantize_dynamic(prepared, dst, weight_type=QuantType.QInt8, per_channel=per_channel)
        else:
            reader = _BatchReader(calibration, names)
            quantize_static(prepared, dst, reader, quant_format=QuantFormat.QDQ, per_channel=True)
    except Exception as exc:
        raise ExportError(f"ONNX Runtime could not quantize {src.name} ({method}): {describe_error(exc)}") from exc
    finally:
        prepared.unlink(missing_ok=True)
    return {
        "path": str(dst),
        "method": method,
        "quant_format": "QOperator" if method == "int8_dynamic" else "QDQ",
        "per_channel": method == "int8_static" or per_channel,
        "bytes": dst.stat().st_size,
        "src_bytes": src.stat().st_size,
    }


def to_fp16(src: Path, dst: Path) -> dict[str, Any]:
    """Write a float16 version of the ONNX file ``src`` (weights and compute) to ``dst``.

    Inputs and outputs stay float32, so callers feed and read it as before; casts at the graph's
    edges convert. Most useful on CUDA: ONNX Runtime's CPU provider runs the operators it has
    no float16 kernel for through casts to float32.

    Returns:
        ``{"path", "bytes", "src_bytes", "keep_io_types"}``.

    Raises:
        ExportError: the conversion failed.
    """
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    src, dst = Path(src), Path(dst)
    try:
        converted = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
        onnx.save(converted, str(dst))
    except Exception as exc:
        raise ExportError(f"Could not convert {src.name} to float16: {describe_error(exc)}") from exc
    return {"path": str(dst), "bytes": dst.stat().st_size, "src_bytes": src.stat().st_size, "keep_io_types": True}
