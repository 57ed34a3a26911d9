"""The cheap pass of ONNX Runtime int8 sensitivity: each layer's int8 error emulated in numpy
from the float model's own activations, as the runtime's kernels compute it on this CPU
(including the saturating uint8 x int8 pair sums of x86 CPUs without VNNI)."""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autotune.compress.sensitivity import (  # noqa: F401
    _BACKENDS,
    _FLOAT_TYPES,
    _LAYER_OPS,
    _TARGET_KEYS,
    METHODS,
    Ranking,
    Score,
    _candidates,
    _check_batches,
    _check_float,
    _check_ranking,
    _model_inputs,
    _order,
    _outcome,
    _refine,
    _search,
)
from autotune.errors import InputError

__all__ = ["_cheap_onnx"]


def _qparams(lo: Any, hi: Any, qmin: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point for [lo, hi] widened to hold 0, as ONNX Runtime's ``compute_scale_zp``:
    symmetric (zero point 0) when ``qmin == -qmax``."""
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    if qmin == -qmax:
        hi = np.maximum(-lo, hi)
        lo = -hi
    scale = ((np.asarray(hi, np.float64) - lo) / (qmax - qmin)).astype(np.float32)
    scale = np.where(scale > np.finfo(np.float32).tiny, scale, np.float32(1.0))
    zero = np.zeros_like(scale) if qmin == -qmax else np.clip(np.rint(qmin - lo / scale), qmin, qmax)
    return scale, zero


def _codes(x: np.ndarray, scale: Any, zero: Any, qmin: int, qmax: int) -> np.ndarray:
    return np.clip(np.rint(x / scale) + zero, qmin, qmax)


def _fake_quant(x: np.ndarray, lo: Any, hi: Any, qmin: int, qmax: int, axis: int | None = None) -> np.ndarray:
    """``x`` quantized to [qmin, qmax] on [lo, hi] and dequantized; per channel along ``axis``."""
    scale, zero = _qparams(lo, hi, qmin, qmax)
    if axis is not None:
        shape = [1] * x.ndim
        shape[axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return ((_codes(x, scale, zero, qmin, qmax) - zero) * scale).astype(x.dtype)


def _symmetric_weight(w: np.ndarray, axis: int | None) -> np.ndarray:
    """Int8 weight in [-127, 127], ONNX Runtime's default for QInt8 weights (``WeightSymmetric``)."""
    if axis is None:
        return _fake_quant(w, float(w.min()), float(w.max()), -127, 127)
    other = tuple(d for d in range(w.ndim) if d != axis)
    return _fake_quant(w, w.min(axis=other), w.max(axis=other), -127, 127, axis=axis)


def _weight_axis(node: Any) -> int:
    """The output-channel axis ONNX Runtime's QDQ quantizer uses for per-channel weights."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "Gemm":
        return 0 if any(a.name == "transB" and a.i for a in node.attribute) else 1
    return 1


def _activation_inputs(node: Any, inits: set[str]) -> list[int]:
    """Indices of the inputs the quantizer treats as activations."""
    if node.op_type == "MatMul":
        return [i for i in (0, 1) if node.input[i] not in inits]
    return [0]


def _quantized_inputs(
    node: Any, arrays: list[list], inits: set[str], method: str, ranges: dict, per_channel: bool
) -> list[list]:
    """Per batch, the node's inputs as int8 would feed them: ``arrays[b][i]`` for input ``i``."""
    acts = _activation_inputs(node, inits)
    out = []
    for batch in arrays:
        row = list(batch)
        for i in acts:
            if method == "int8_dynamic":  # DynamicQuantizeLinear: uint8 on this batch's own range
                row[i] = _fake_quant(batch[i], float(batch[i].min()), float(batch[i].max()), 0, 255)
            else:
                row[i] = _fake_quant(batch[i], *ranges[node.input[i]], 0, 255)
        if node.input[1] in inits:
            # Dynamic ConvInteger scales its weight per tensor even when asked for channels.
            channels = per_channel and (method == "int8_static" or node.op_type != "Conv")
            axis = _weight_axis(node) if channels else None
            row[1] = _symmetric_weight(batch[1], axis)
        out.append(row)
    return out


def _u8s8_saturates() -> bool:
    """Whether ONNX Runtime's uint8 x int8 kernels on this CPU add products in int16 pairs that
    saturate (x86 without VNNI: ``VPMADDUBSW``, a loss its documentation warns of)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return not any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def _saturation(a: np.ndarray, a_range: tuple, w: np.ndarray, per_channel: bool) -> np.ndarray:
    """What int16 pair saturation adds to ``a @ w`` (a: (M, K) activations, w: (K, N) weights)
    when both are quantized: ``sum(clip(p) - p)`` over the pairs ``p`` of adjacent products of
    uint8 and int8 codes, in the output's units. Mostly zeros."""
    sa, za = _qparams(*a_range, 0, 255)
    sw, _ = _qparams(w.min(axis=0), w.max(axis=0), -127, 127) if per_channel else _qparams(w.min(), w.max(), -127, 127)
    qa, qw = _codes(a, sa, za, 0, 255).astype(np.int32), _codes(w, sw, 0, -127, 127).astype(np.int32)
    if qa.shape[1] % 2:  # an odd K pairs its last product with a zero
        qa, qw = np.pad(qa, ((0, 0), (0, 1))), np.pad(qw, ((0, 1), (0, 0)))
    a0, a1, w0, w1 = qa[:, 0::2], qa[:, 1::2], qw[0::2], qw[1::2]
    # |a0 w0 + a1 w1| <= max(a0, a1) (|w0| + |w1|): a bound that splits into a row and a column
    # part, so only the few pairs, rows and columns that can pass 32767 are multiplied out.
    row_max, col_sum = np.maximum(a0, a1), np.abs(w0) + np.abs(w1)
    delta = np.zeros((qa.shape[0], qw.shape[1]), np.int64)
    for j in np.nonzero(row_max.max(axis=0) * col_sum.max(axis=1) > 32767)[0]:
        rows = np.nonzero(row_max[:, j] * col_sum[j].max() > 32767)[0]
        cols = np.nonzero(col_sum[j] * row_max[rows, j].max() > 32767)[0]
        pairs = a0[rows, j, None] * w0[j, cols] + a1[rows, j, None] * w1[j, cols]
        delta[np.ix_(rows, cols)] += np.clip(pairs, -32768, 32767) - pairs
    return (delta * (sa * sw)).astype(np.float32)


def _saturating_operands(node: Any, inputs: list, inits: set[str], method: str) -> tuple | None:
    """``(a, w, alpha, to_rows)`` of a layer whose product ONNX Runtime runs as uint8 x int8 with
    pair saturation, else ``None``: ``a @ w`` with a (M, K) and w (K, N) is the layer's output
    as ``to_rows`` lays it out, (M, N). MatMul and Gemm with a constant weight; static 2-D Conv
    with one group (measured: ConvInteger does not saturate, QLinearConv does)."""
    attrs = {a.name: a for a in node.attribute}
    if node.input[1] not in inits:
        return None
    if node.op_type == "Conv":
        return _conv_operands(attrs, *inputs[:2]) if method == "int8_static" else None
    if inputs[1].ndim != 2 or (node.op_type == "Gemm" and "transA" in attrs and attrs["transA"].i):
        return None
    w = inputs[1].T if "transB" in attrs and attrs["transB"].i else inputs[1]
    alpha = attrs["alpha"].f if "alpha" in attrs else 1.0
    return inputs[0].reshape(-1, w.shape[0]), w, alpha, lambda y: y.reshape(-1, w.shape[1])


def _conv_operands(attrs: dict, x: np.ndarray, w: np.ndarray) -> tuple | None:
    """A 2-D Conv as a matrix product over an im2col laid out as ONNX Runtime's NHWC kernels
    read it: each row one output pixel, its columns kernel position-major, channel-minor."""
    group = attrs["group"].i if "group" in attrs else 1
    auto_pad = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
    if w.ndim != 4 or x.ndim != 4 or group != 1 or auto_pad != "NOTSET":
        return None
    top, left, bottom, right = list(attrs["pads"].ints) if "pads" in attrs else [0, 0, 0, 0]
    strides = list(attrs["strides"].ints) if "strides" in attrs else [1, 1]
    dilations = list(attrs["dilations"].ints) if "dilations" in attrs else [1, 1]
    out, channels, kh, kw = w.shape
    padded = torch.nn.functional.pad(torch.from_numpy(x), (left, right, top, bottom))  # zeros: the zero point
    cols = torch.nn.functional.unfold(padded, (kh, kw), dilation=dilations, stride=strides)  # (N, C*kh*kw, L)
    n, _, length = cols.shape
    a = cols.reshape(n, channels, kh * kw, length).permute(0, 3, 2, 1).reshape(n * length, -1).numpy()
    matrix = w.transpose(2, 3, 1, 0).reshape(-1, out)
    return a, matrix, 1.0, lambda y: np.moveaxis(y, 1, -1).reshape(-1, out)


_SATURATION_ROWS = 256  # rows per batch the saturation emulation looks at, bounding its worst case


def _node_session(node: Any, example: list[np.ndarray], model: Any) -> Any:
    """A session running ``node`` alone, its inputs renamed ``in_0, in_1, ...`` and fed."""
    import onnx
    from onnx import helper

    single = onnx.NodeProto()
    single.CopyFrom(node)
    del single.input[:], single.output[:]
    single.input.extend(f"in_{i}" if name else "" for i, name in enumerate(node.input))
    single.output.append("out")
    # Rank only: calibration batches of token sequences differ in width from batch to batch.
    inputs = [
        helper.make_tensor_value_info(f"in_{i}", helper.np_dtype_to_tensor_dtype(a.dtype), [None] * a.ndim)
        for i, a in enumerate(example)
        if node.input[i]
    ]
    graph = helper.make_graph([single], "layer", inputs, [onnx.ValueInfoProto(name="out")])
    proto = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    return _session(proto.SerializeToString())


def _capturer(model: Any, nodes: list[Any]) -> Callable[[int, dict], dict[str, np.ndarray]]:
    """``capture(i, feed)``: every tensor the layers read or write on one batch, from one run of
    the float graph; one batch at a time, so only that batch's tensors are held."""
    import onnx

    inits = {t.name for t in model.graph.initializer}
    wanted = list(dict.fromkeys(n for node in nodes for n in [*node.input, node.output[0]] if n and n not in inits))
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    present = {o.name for o in augmented.graph.output} | {i.name for i in augmented.graph.input}
    for name in wanted:
        if name not in present:
            augmented.graph.output.append(onnx.ValueInfoProto(name=name))  # ONNX Runtime infers the type
    session = _session(augmented.SerializeToString())
    names = [o.name for o in session.get_outputs()]

    def capture(i: int, feed: dict) -> dict[str, np.ndarray]:
        try:
            outs = session.run(None, feed)
        except Exception as exc:
            text = " ".join(str(exc).split())[:300]
            raise InputError(f"The float graph fails on calibration batch {i}: {type(exc).__name__}: {text}") from exc
        return {**feed, **dict(zip(names, outs, strict=True))}

    return capture


def _each(feeds: list[dict], capture: Callable, use: Callable[[dict], None], deadline: float | None) -> int:
    """``use`` each batch's captured tensors in turn, then drop them; stop after the batch that
    passes ``deadline`` (at least one runs). Returns the number of batches used."""
    for i, feed in enumerate(feeds):
        use(capture(i, feed))
        if deadline is not None and time.perf_counter() >= deadline:
            return i + 1
    return len(feeds)


def _layer_error(node: Any, inputs: list, y_q: np.ndarray, y: np.ndarray, job: dict) -> tuple[float, float]:
    """(||y_q - y||^2, ||y||^2) of one layer on one batch; ``y_q`` computed from fake-quantized
    inputs, corrected for int16 pair saturation where this CPU's kernels saturate."""
    operands = _saturating_operands(node, inputs, job["inits"], job["method"]) if job["saturate"] else None
    if operands is not None:
        a, w, alpha, to_rows = operands
        rows = np.linspace(0, len(a) - 1, min(len(a), _SATURATION_ROWS)).round().astype(int)
        static = job["method"] == "int8_static"
        a_range = job["ranges"][node.input[0]] if static else (inputs[0].min(), inputs[0].max())
        y, y_q = to_rows(y)[rows], to_rows(y_q)[rows]
        y_q = y_q + alpha * _saturation(a[rows], a_range, w, per_channel=job["per_channel"])
    if job["method"] == "int8_static":  # the QDQ quantizer quantizes the layer's output too
        y_q = _fake_quant(y_q, *job["ranges"][node.output[0]], 0, 255)
    return float(np.sum((y_q.astype(np.float64) - y) ** 2)), float(np.sum(y.astype(np.float64) ** 2))


def _cheap_onnx(
    model: Any,
    nodes: list[Any],
    feeds: list[dict],
    method: str,
    *,
    per_channel: bool = False,
    deadline: float | None = None,
) -> tuple[dict[str, float], int]:
    """Each layer's relative int8 error alone, streamed batch by batch (a batch's tensors are
    dropped before the next is captured); ``int8_static`` first takes each activation's range
    over the batches, two numbers each. Returns ``(errors, batches used)``."""
    from onnx import numpy_helper

    capture = _capturer(model, nodes)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    acts = {n for node in nodes for n in [*node.input, node.output[0]] if n and n not in weights}
    ranges: dict[str, tuple[float, float]] = {}  # static int8: each activation's range over the batches

    def widen(c: dict) -> None:
        for name in acts:
            lo, hi = ranges.get(name, (math.inf, -math.inf))
            ranges[name] = (min(lo, float(c[name].min())), max(hi, float(c[name].max())))

    if method == "int8_static":
        feeds = feeds[: _each(feeds, capture, widen, deadline)]
    per_channel = per_channel or method == "int8_static"
    job = {"method": method, "ranges": ranges, "inits": set(weights), "saturate": _u8s8_saturates()}
    job["per_channel"] = per_channel
    sessions: dict[str, Any] = {}
    sums = {node.name: [0.0, 0.0] for node in nodes}

    def compare(c: dict) -> None:
        for node in nodes:
            inputs = [c[n] if n in c else weights.get(n) for n in node.input]
            row = _quantized_inputs(node, [inputs], set(weights), method, ranges, per_channel)[0]
            if node.name not in sessions:
                sessions[node.name] = _node_session(node, inputs, model)
            y_q = sessions[node.name].run(None, {f"in_{i}": a for i, a in enumerate(row) if node.input[i]})[0]
            d_num, d_den = _layer_error(node, inputs, y_q, c[node.output[0]], job)
            sums[node.name][0] += d_num
            sums[node.name][1] += d_den

    used = _each(feeds, capture, compare, deadline)
    errors = {name: math.sqrt(n / d) if d > 0 else (0.0 if n == 0 else math.inf) for name, (n, d) in sums.items()}
    return errors, used


def _session(model: Any) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # the quantized graphs' "unused initializer" notes are noise
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _run_all(session: Any, feeds: list[dict], what: str) -> list[list[np.ndarray]]:
    out = []
    for i, feed in enumerate(feeds):
        try:
            out.append(session.run(None, feed))
        except Exception as exc:
            text = " ".join(str(exc).split())[:300]
            raise InputError(f"{what} fails on calibration batch {i}: {type(exc).__name__}: {text}") from exc
    return out
