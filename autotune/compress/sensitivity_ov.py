"""INT8 sensitivity and fallback for OpenVINO: rank the layers NNCF quantizes by how much int8
hurts each alone, and quantize all but the most sensitive (NNCF's ``IgnoredScope``).

The layers are the ops whose inputs NNCF's static int8 quantizes (MatMul, Convolution, ...), by
their OpenVINO names. The cheap pass runs the float model on the calibration batches and, for
each layer, runs the layer alone on its own float inputs with int8 emulated as the CPU plugin
runs it (activations uint8 per tensor on their range over the batches, weights int8 per output
channel, both as ``FakeQuantize``), measuring ``||y_int8 - y|| / ||y||``. The search for how
many to keep float quantizes the whole model with NNCF each time and scores it with the guard's
criterion, so what passes is what ships.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from autotune.compress.int8_gain import gain_batches
from autotune.compress.sensitivity import (
    Deferred,
    Ranking,
    Score,
    _check_batches,
    _check_float,
    _check_keep,
    _check_ranking,
    _order,
    _outcome,
    _search,
    speed_ratio,
)
from autotune.errors import TrialError

__all__ = ["fallback_openvino", "openvino_layers", "quantize_openvino_except", "rank_openvino"]

METHOD = "int8_static"


def _source(op: Any, port: int) -> Any:
    return op.input_value(port).get_node()


def _constant(node: Any, depth: int = 6) -> bool:
    """Whether ``node`` computes a constant: a Constant, or ops on constants only (NNCF's int8
    weights are a Constant, a Convert and a dequantizing Multiply)."""
    if node.get_type_name() == "Constant":
        return True
    if depth == 0 or node.get_input_size() == 0:
        return False
    return all(_constant(node.input_value(i).get_node(), depth - 1) for i in range(node.get_input_size()))


def _int8_weight(node: Any) -> bool:
    """NNCF's int8 weight: a constant computed from an 8-bit Constant."""
    if not _constant(node) or node.get_type_name() == "Constant":
        return False
    stack = [node]
    while stack:
        n = stack.pop()
        if n.get_type_name() == "Constant" and n.get_element_type().get_type_name() in ("i8", "u8", "i4", "u4"):
            return True
        stack += [n.input_value(i).get_node() for i in range(n.get_input_size())]
    return False


def _quantized_ports(op: Any) -> list[int]:
    """The input ports of a layer ``op`` that NNCF quantized: fed by a FakeQuantize or an int8
    weight (none for the FakeQuantize and weight ops themselves)."""
    if op.get_type_name() == "FakeQuantize" or _constant(op):
        return []
    return [
        i
        for i in range(op.get_input_size())
        if _source(op, i).get_type_name() == "FakeQuantize" or _int8_weight(_source(op, i))
    ]


def openvino_layers(quantized: Any) -> list[str]:
    """The names of the ops an NNCF int8 model quantizes (some input port fed by a FakeQuantize
    or an int8 weight), in graph order: the names its ``IgnoredScope`` takes.

    Example:
        >>> openvino_layers(nncf.quantize(model, dataset))[:1]  # doctest: +SKIP
        ['__module.model.net.0/aten::linear/MatMul']
    """
    return [op.get_friendly_name() for op in quantized.get_ordered_ops() if _quantized_ports(op)]


def _outputs(compiled: Any, feeds: Sequence[dict], what: str) -> list:
    """One output per batch (an array, or a list of them for several outputs)."""
    request = compiled.create_infer_request()
    outs = []
    for i, feed in enumerate(feeds):
        try:
            values = list(request.infer(feed, share_outputs=False).to_tuple())
        except Exception as exc:
            text = " ".join(str(exc).split())[:300]
            raise TrialError(
                "unsupported", f"{what} fails on calibration batch {i}: {type(exc).__name__}: {text}"
            ) from exc
        outs.append(values[0] if len(values) == 1 else values)
    return outs


def _compile(model: Any) -> Any:
    from autotune.export.ov_run import compile_config, core

    return core().compile_model(model, "CPU", compile_config("f32"))


def _weight_fq(w: np.ndarray, op: Any) -> np.ndarray:
    """``w`` in symmetric int8 with one scale per output channel, dequantized."""
    kind = op.get_type_name()
    if kind == "MatMul" and w.ndim >= 2:
        channel = {w.ndim - 2} if op.get_attributes().get("transpose_b") else {w.ndim - 1}
    elif kind == "GroupConvolution":
        channel = {0, 1}
    else:
        channel = {0}
    axes = tuple(a for a in range(w.ndim) if a not in channel)
    scale = np.maximum(np.abs(w).max(axis=axes, keepdims=True), 1e-12) / 127
    return (np.clip(np.round(w / scale), -127, 127) * scale).astype(w.dtype)


# The layer types emulated alone; NNCF quantizes these in the models autotune meets. Another type
# (an Add of a residual, say) is ranked last: its cheap error counts as 0.
_EMULATED = ("MatMul", "Convolution", "GroupConvolution")


def _rebuilt(op: Any, inputs: list[Any]) -> Any:
    """A new op like ``op`` (same type and attributes) on ``inputs``, or ``None`` for a type
    not in :data:`_EMULATED`."""
    import openvino.opset13 as ops

    a = op.get_attributes()
    kind = op.get_type_name()
    if kind == "MatMul":
        return ops.matmul(inputs[0], inputs[1], a["transpose_a"], a["transpose_b"])
    if kind in ("Convolution", "GroupConvolution"):
        make = ops.convolution if kind == "Convolution" else ops.group_convolution
        args = (a["strides"], a["pads_begin"], a["pads_end"], a["dilations"], str(a["auto_pad"]).upper())
        return make(inputs[0], inputs[1], *args)
    return None


class _Layers:
    """The float model's quantizable layers: their float inputs and outputs captured on a batch,
    and each one alone with int8 emulated."""

    def __init__(self, float_model: Any, quantized: Any) -> None:
        import openvino as ov
        import openvino.opset13 as ops

        self.names = openvino_layers(quantized)
        by_name = {op.get_friendly_name(): op for op in quantized.get_ordered_ops()}
        clone = float_model.clone()
        ops_f = {op.get_friendly_name(): op for op in clone.get_ordered_ops()}
        missing = [n for n in self.names if n not in ops_f]
        if missing:
            raise TrialError("unsupported", f"NNCF renamed layers of the model ({missing[:3]}); cannot rank them")
        # Per layer: (its op in the float clone, ports quantized with a range, ports with an int8
        # weight, float ports fed by the graph: a CNN's first convolution, whose input NNCF left
        # float, read the model's own input, which its layer alone does not declare).
        self.plan: dict[str, tuple[Any, list[int], list[int], list[int]]] = {}
        wanted: list[Any] = []
        for name in self.names:
            op, q = ops_f[name], by_name[name]
            ports = _quantized_ports(q)
            weights = [p for p in ports if _source(op, p).get_type_name() == "Constant"]
            acts = [p for p in ports if p not in weights]
            floats = [p for p in range(op.get_input_size()) if p not in ports and not _constant(_source(op, p))]
            self.plan[name] = (op, acts, weights, floats)
            wanted += [op.input_value(p) for p in acts + floats] + [op.output(0)]
        capture = ov.Model([ops.result(o) for o in wanted], clone.get_parameters(), "capture")
        self.capture = _compile(capture)
        self.bounds: dict[tuple[str, int], tuple[float, float]] = {}
        self._singles: dict[str, Any] = {}

    def captured(self, feed: dict) -> dict[str, tuple[list[np.ndarray], np.ndarray]]:
        """Each layer's float inputs (its quantized activations, then its float ports) and float
        output on one batch."""
        values = list(self.capture.create_infer_request().infer(feed, share_outputs=False).to_tuple())
        found, k = {}, 0
        for name, (_, acts, _, floats) in self.plan.items():
            n = len(acts) + len(floats)
            found[name] = (values[k : k + n], values[k + n])
            k += n + 1
        return found

    def observe(self, captured: dict[str, tuple[list[np.ndarray], np.ndarray]]) -> None:
        for name, (inputs, _) in captured.items():
            acts = self.plan[name][1]
            for port, x in zip(acts, inputs[: len(acts)], strict=True):
                lo, hi = self.bounds.get((name, port), (math.inf, -math.inf))
                self.bounds[name, port] = (min(lo, float(x.min())), max(hi, float(x.max())))

    def single(self, name: str) -> Any:
        """The layer alone, compiled: its activations through FakeQuantize on their range, its
        weights int8 per channel."""
        if name not in self._singles:
            import openvino as ov
            import openvino.opset13 as ops

            op, acts, weights, floats = self.plan[name]
            inputs, params = [], {}
            for port in range(op.get_input_size()):
                value = op.input_value(port)
                if port in weights:
                    inputs.append(ops.constant(_weight_fq(value.get_node().get_data(), op)).output(0))
                elif port in acts or port in floats:
                    params[port] = ops.parameter(value.get_partial_shape(), value.get_element_type())
                    if port in floats:  # left float by NNCF: as it is
                        inputs.append(params[port].output(0))
                        continue
                    lo, hi = self.bounds[name, port]
                    lo, hi = np.float32(min(lo, 0.0)), np.float32(max(hi, 0.0))
                    inputs.append(ops.fake_quantize(params[port], lo, hi, lo, hi, 256).output(0))
                else:
                    inputs.append(value)  # a float input of the layer's own (constant): as it is
            params = [params[p] for p in acts + floats]  # the order captured() gives their values in
            layer = _rebuilt(op, inputs)
            self._singles[name] = None if layer is None else _compile(ov.Model([layer.output(0)], params, name))
        return self._singles[name]


def rank_openvino(float_model: Any, quantized: Any, feeds: Sequence[dict], *, budget_s: float | None = None) -> Ranking:
    """Rank the layers NNCF quantized in ``quantized`` by how much int8 hurts each alone on the
    float model ``float_model`` (the cheap pass of the module docstring), most sensitive first.

    Args:
        float_model: The float ``openvino.Model``.
        quantized: ``float_model`` as NNCF quantized it (every layer it takes).
        feeds: Calibration batches, as :func:`autotune.export.openvino.calibration_feeds` makes them.
        budget_s: Seconds after which no further batch is used (at least one always is).

    Raises:
        InputError: no batches.
        TrialError: kind ``unsupported``: nothing quantized, or the model fails on a batch.
    """
    _check_batches(list(feeds))
    start = time.perf_counter()
    layers = _Layers(float_model, quantized)
    if not layers.names:
        raise TrialError("unsupported", "NNCF quantized no layer of the model: nothing to rank or keep float")
    used = []
    for feed in feeds:  # the activations' ranges over the batches, as calibration takes them
        layers.observe(layers.captured(feed))
        used.append(feed)
        if budget_s is not None and time.perf_counter() - start >= budget_s / 2:
            break
    sums = {name: [0.0, 0.0] for name in layers.names}
    for feed in used:
        for name, (inputs, y) in layers.captured(feed).items():
            single = layers.single(name)
            if single is None:  # not emulated: ranked last
                continue
            y_q = single.create_infer_request().infer(inputs, share_outputs=False).to_tuple()[0]
            y64 = y.astype(np.float64)
            sums[name][0] += float(np.sum((y_q.astype(np.float64) - y64) ** 2))
            sums[name][1] += float(np.sum(y64**2))
    errors = {n: math.sqrt(a / b) if b > 0 else (0.0 if a == 0 else math.inf) for n, (a, b) in sums.items()}
    return Ranking(METHOD, "openvino", _order(errors, {}), errors, {}, time.perf_counter() - start, len(used))


def quantize_openvino_except(
    float_model: Any, keep_float: Sequence[str], feeds: Sequence[dict], layers: Sequence[str], transformer: bool
) -> Any:
    """``float_model`` in NNCF int8 with the layers in ``keep_float`` left float.

    Raises:
        InputError: a name in ``keep_float`` is not one of ``layers``, or all of them are.
    """
    from autotune.export.openvino import quantize_openvino

    keep = _check_keep(keep_float, list(layers))
    return quantize_openvino(float_model, feeds, ignored=keep, transformer=transformer)


def fallback_openvino(
    float_model: Any,
    quantized: Any,
    ranking: Ranking | Deferred,
    feeds: Sequence[dict],
    score: Score,
    threshold: float,
    *,
    k: int | str = "auto",
    transformer: bool = False,
    budget_s: float | None = None,
    floor: int = 0,
    check_gain: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """The NNCF int8 model with the ``k`` most sensitive layers float (``"auto"``: the fewest
    whose outputs score ``>= threshold``), and the search's record.

    Args:
        float_model: The float ``openvino.Model``.
        quantized: It quantized whole (k = 0), as :func:`rank_openvino` ranked it.
        ranking: Its ranking.
        feeds: Calibration batches; the float model's outputs on them are the reference.
        score, threshold: The guard's criterion (``score(reference, candidate) >= threshold``).
        k: How many layers to keep float, or ``"auto"``.
        transformer: NNCF's transformer scheme.
        budget_s: Seconds after which ``auto`` stops at the fewest measured to pass.
        check_gain: Where the whole-int8 model misses the guard, ``auto`` first times it
            against the float one and stops where int8 does not pay (:func:`_search`).

    Returns:
        ``(model or None, record)``: the record as :func:`autotune.compress.sensitivity_onnx.fallback_onnx`
        gives it (``kept``, ``k``, ``score``, ``n_layers``, ``feasible``, ``reason``, ``tries``);
        the model is ``None`` when only the float model passes.

    Raises:
        InputError: the ranking is for another model, or the float model scores below ``threshold``.
        TrialError: kind ``unsupported``: NNCF failed.
    """
    layers = openvino_layers(quantized)
    _check_ranking(ranking, "openvino", METHOD, layers)
    float_compiled = _compile(float_model)
    reference = _outputs(float_compiled, feeds, "The float model")
    _check_float(score, reference, threshold)
    models: dict[int, Any] = {0: quantized}
    whole: list[Any] = []  # the whole-int8 model compiled, until gain() times it

    def try_k(j: int) -> float:
        if j not in models:
            models[j] = quantize_openvino_except(float_model, ranking.top(j), feeds, layers, transformer)
        compiled = _compile(models[j])
        if j == 0 and check_gain:
            whole.append(compiled)
        return score(reference, _outputs(compiled, feeds, "The int8 model"))

    def gain() -> float:
        int8 = whole.pop() if whole else _compile(quantized)
        timed = gain_batches(feeds)
        return speed_ratio(lambda: _outputs(float_compiled, timed, "The float model"),
                           lambda: _outputs(int8, timed, "The int8 model"))  # fmt: skip

    deadline = None if budget_s is None else time.perf_counter() + budget_s
    found = _search(len(layers), k, threshold, try_k, deadline, floor, gain=gain if check_gain else None)
    result = _outcome(found, layers, ranking, threshold)
    chosen = models.get(result["k"]) if result["k"] < len(layers) else None
    return chosen, result
