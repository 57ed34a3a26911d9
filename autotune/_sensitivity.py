"""INT8 that holds accuracy: rank layers by how much int8 hurts them, keep the worst float.

Quantizing every layer of a model to int8 can ruin it while quantizing all but a few keeps
almost all the speed: one layer whose input has an outlier channel loses everything to a
per-tensor activation scale. This module ranks the quantizable layers (ONNX Runtime dynamic or
static int8, PyTorch dynamic int8), then finds the fewest of the most sensitive ones to keep in
float so that a caller's criterion holds.

Ranking has two passes. The cheap one runs the float model once, captures each layer's input and
output, and measures the relative error int8 causes at that layer alone
(``||y_int8 - y|| / ||y||``), emulating the int8 arithmetic as the runtime does it on this CPU.
The exact one quantizes a single layer of the whole model and scores the model's outputs with
the caller's criterion; it runs only for the layers the cheap pass puts at the top, within a
time budget.

A criterion (``score``) takes the float model's outputs and a candidate's, one entry per
calibration batch, and returns a number where higher is better; a candidate passes when
``score >= threshold``. :func:`worst_cosine` and :func:`max_rel_error` are two such criteria.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .errors import ConfigError, InputError, TrialError

__all__ = [
    "METHODS",
    "Ranking",
    "worst_cosine",
    "max_rel_error",
    "onnx_layers",
    "rank_onnx",
    "quantize_onnx_except",
    "fallback_onnx",
    "torch_layers",
    "rank_torch",
    "quantize_torch_except",
    "fallback_torch",
]

Score = Callable[[list, list], float]

METHODS = ("int8_dynamic", "int8_static")
_BACKENDS = {"onnxruntime": METHODS, "torch": ("int8_dynamic",)}
_LAYER_OPS = ("MatMul", "Gemm", "Conv")
_FLOAT_TYPES = (1, 10, 11, 16)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16
_TARGET_KEYS = frozenset({"label", "labels", "target", "targets", "y"})  # as autotune.data.TARGET_KEYS


# --- criteria ---------------------------------------------------------------------------------


def _leaves(obj: Any) -> list[np.ndarray]:
    """The arrays of one batch's output in a fixed order (dict values in insertion order)."""
    if isinstance(obj, torch.Tensor):
        return [obj.detach().cpu().to(torch.float64).numpy()]
    if isinstance(obj, np.ndarray | np.generic | float | int):
        return [np.asarray(obj, dtype=np.float64)]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    elif hasattr(obj, "to_tuple"):
        obj = obj.to_tuple()
    if isinstance(obj, tuple | list):
        return [leaf for item in obj for leaf in _leaves(item)]
    return []  # None, strings: nothing to compare


def _rows(output: Any) -> np.ndarray:
    """One batch's output as (samples, features): each leaf flattened past its first axis."""
    leaves = _leaves(output)
    if not leaves:
        raise InputError(f"A model output holds no tensor or array to score, but got a {type(output).__name__}.")
    n = leaves[0].shape[0] if leaves[0].ndim else 1
    if all(leaf.ndim and leaf.shape[0] == n for leaf in leaves):
        return np.concatenate([leaf.reshape(n, -1) for leaf in leaves], axis=1)
    return np.concatenate([leaf.ravel() for leaf in leaves])[None]  # no common batch axis: one row


def _paired_rows(reference: Any, candidate: Any) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    reference = reference if isinstance(reference, list) else [reference]
    candidate = candidate if isinstance(candidate, list) else [candidate]
    if len(reference) != len(candidate):
        raise InputError(f"Scores compare batch by batch, but got {len(reference)} and {len(candidate)} batches.")
    for ref, cand in zip(reference, candidate, strict=True):
        a, b = _rows(ref), _rows(cand)
        if a.shape != b.shape:
            raise InputError(f"A candidate's output has shape {b.shape}, but the reference's is {a.shape}.")
        yield a, b


def worst_cosine(reference: list, candidate: list) -> float:
    """The lowest cosine similarity between a reference and a candidate sample, over all batches.

    Each sample is a row: every output leaf flattened past its batch axis and concatenated. Identical
    rows (two all-zero ones too) count as 1, one all-zero row as 0, a row with NaN as -1.

    Args:
        reference: The float model's outputs, one per batch (tensors, arrays or nests of them).
        candidate: The quantized model's outputs on the same batches.

    Example:
        >>> worst_cosine([np.eye(2)], [np.array([[1.0, 0.0], [1.0, 1.0]])])  # doctest: +ELLIPSIS
        0.707...
    """
    worst = 1.0
    for a, b in _paired_rows(reference, candidate):
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        zero_a, zero_b = ~np.any(a, axis=1), ~np.any(b, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = np.where(norms > 0, (a * b).sum(1) / norms, np.where(zero_a & zero_b, 1.0, 0.0))
        # Identical rows score exactly 1 (rounding can leave a row's cosine with itself below 1).
        cos = np.where(np.all(a == b, axis=1), 1.0, np.where(np.isfinite(b).all(axis=1), cos, -1.0))
        worst = min(worst, float(cos.min(initial=1.0)))
    return worst


def max_rel_error(reference: list, candidate: list) -> float:
    """The largest per-sample relative error ``||c - r|| / ||r||``, negated so higher is better.

    A threshold of ``-0.05`` accepts candidates whose every sample is within 5 % of the reference.

    Example:
        >>> max_rel_error([np.ones((2, 4))], [np.full((2, 4), 1.1)])  # doctest: +ELLIPSIS
        -0.1...
    """
    worst = 0.0
    for a, b in _paired_rows(reference, candidate):
        diff, norm = np.linalg.norm(b - a, axis=1), np.linalg.norm(a, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(norm > 0, diff / norm, np.where(diff > 0, np.inf, 0.0))
        worst = max(worst, float(np.nan_to_num(rel, nan=np.inf).max(initial=0.0)))
    return -worst


# --- the ranking ------------------------------------------------------------------------------


@dataclasses.dataclass
class Ranking:
    """Quantizable layers, most sensitive to int8 first.

    Attributes:
        method: ``"int8_dynamic"`` or ``"int8_static"``.
        backend: ``"onnxruntime"`` or ``"torch"``.
        layers: Layer names (ONNX node names, or module names), most sensitive first.
        cheap_error: Every layer's relative output error when it alone runs in int8.
        exact_score: The criterion on the model's outputs with that layer alone in int8, for the
            layers refined (lower is more sensitive).
        cost_s: Seconds the ranking took.
        n_batches: Calibration batches it ran on.
    """

    method: str
    backend: str
    layers: list[str]
    cheap_error: dict[str, float]
    exact_score: dict[str, float] = dataclasses.field(default_factory=dict)
    cost_s: float = 0.0
    n_batches: int = 1

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ConfigError(f"No ranking backend named {self.backend!r}. Known: {', '.join(_BACKENDS)}.")
        if self.method not in _BACKENDS[self.backend]:
            known = ", ".join(_BACKENDS[self.backend])
            raise ConfigError(f"No {self.backend} int8 method named {self.method!r}. Known: {known}.")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError("`layers` must name each layer once, but some repeat.")
        if set(self.cheap_error) != set(self.layers) or not set(self.exact_score) <= set(self.layers):
            raise ConfigError("`cheap_error` must cover exactly `layers`, and `exact_score` only layers in it.")
        if self.n_batches < 1 or self.cost_s < 0:
            raise ConfigError(f"`n_batches` must be >= 1 and `cost_s` >= 0, but got {self.n_batches}, {self.cost_s}.")

    def top(self, k: int) -> list[str]:
        """The ``k`` most sensitive layers."""
        return list(self.layers[:k])

    def to_json(self) -> str:
        """The ranking as a JSON object (non-finite scores as ``Infinity``/``NaN``, as Python writes)."""
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Ranking:
        """The ranking :meth:`to_json` wrote.

        Raises:
            ConfigError: the text is not a ranking (unknown or missing fields, invalid values).
        """
        data = json.loads(text)
        known = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) - set(known):
            raise ConfigError(f"A ranking is a JSON object with the fields {', '.join(known)}.")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"Not a ranking: {exc}.") from exc


def _order(cheap: dict[str, float], exact: dict[str, float]) -> list[str]:
    """Refined layers by their exact score (worst first), then the rest by cheap error."""

    def key(name: str) -> float:
        s = exact[name]
        return -math.inf if math.isnan(s) else s

    refined = sorted(exact, key=lambda n: (key(n), -cheap[n]))
    rest = sorted((n for n in cheap if n not in exact), key=lambda n: -cheap[n])
    return refined + rest


def _candidates(cheap: dict[str, float], refine: bool | int) -> list[str]:
    """The layers to refine: the top of the cheap ranking, widened while the next one is close.

    ``True`` takes the top quarter (at least 4), then every further layer within a factor of 2
    of the last one taken, where the cheap order is too close to trust.
    """
    order = sorted(cheap, key=lambda n: -cheap[n])
    if refine is False or refine == 0:
        return []
    n = max(4, math.ceil(len(order) / 4)) if refine is True else int(refine)
    n = min(n, len(order))
    while n and n < len(order) and cheap[order[n]] * 2 >= cheap[order[n - 1]]:
        n += 1
    return order[:n]


def _refine(candidates: list[str], measure: Callable[[str], float], budget_s: float | None, start: float) -> dict:
    exact: dict[str, float] = {}
    for name in candidates:
        if budget_s is not None and time.perf_counter() - start >= budget_s:
            break
        exact[name] = float(measure(name))
    return exact


# --- the search for k -------------------------------------------------------------------------


def _search(n: int, k: int | str, threshold: float, try_k: Callable[[int], float]) -> dict[str, Any]:
    """The number of most sensitive layers to keep float: ``k`` itself, or the fewest that pass.

    ``"auto"`` bisects k over [0, n] assuming that keeping more layers float never scores lower;
    k = n (the float model) passes by the caller's check. The result's ``tries`` hold k and k - 1
    measured, the first passing and the second not, which is the bisection's invariant.
    """
    tries: list[dict[str, Any]] = []

    def passes(j: int) -> bool:
        s = float(try_k(j))
        tries.append({"k": j, "score": s, "passed": s >= threshold})
        return s >= threshold

    if k != "auto":
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
            raise ConfigError(f"`k` must be 'auto' or an int in [0, {n}], but got {k!r}.")
        if k < n:
            passes(k)
        return {"k": k, "tries": tries}
    if passes(0):
        return {"k": 0, "tries": tries}
    lo, hi = 0, n  # lo fails, hi passes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return {"k": hi, "tries": tries}


def _outcome(found: dict[str, Any], layers: list[str], ranking: Ranking, threshold: float) -> dict[str, Any]:
    k, n = found["k"], len(layers)
    measured = {t["k"]: t for t in found["tries"]}
    result = {
        "kept": ranking.top(k),
        "k": k,
        "score": measured[k]["score"] if k in measured else None,
        "n_layers": n,
        "threshold": threshold,
        "feasible": k < n and measured[k]["passed"],
        "reason": None,
        "tries": found["tries"],
    }
    if k == n:
        result["reason"] = (
            f"only the float model passes: every one of the {n} layers would stay float, so no int8 at all"
        )
        if n - 1 in measured:
            result["reason"] += f" (keeping {n - 1} float scores {measured[n - 1]['score']:.6g} < {threshold:.6g})"
    elif not result["feasible"]:
        result["reason"] = f"keeping {k} layers float scores {result['score']:.6g} < {threshold:.6g}"
    return result


def _check_ranking(ranking: Ranking, backend: str, method: str, layers: list[str]) -> None:
    if ranking.backend != backend or ranking.method != method:
        raise InputError(
            f"The ranking is for {ranking.backend} {ranking.method}, but this is {backend} {method}; rank again."
        )
    if set(ranking.layers) != set(layers):
        extra, missing = sorted(set(ranking.layers) - set(layers)), sorted(set(layers) - set(ranking.layers))
        raise InputError(f"The ranking is for another model: it names {extra[:5]} not here and lacks {missing[:5]}.")


def _check_float(score: Score, reference: list, threshold: float) -> None:
    s = float(score(reference, reference))
    if not s >= threshold:
        raise InputError(f"Even the float model scores {s:.6g} against itself, below `threshold` {threshold:.6g}.")


def _check_batches(batches: list) -> None:
    if not isinstance(batches, list | tuple) or not batches:
        raise InputError("Ranking and fallback need a non-empty list of calibration batches, but got none.")


def _model_inputs(batch: Any) -> tuple[tuple, dict]:
    """Positional and keyword inputs of a collated batch, as ``autotune.data.model_inputs`` reads one."""
    if isinstance(batch, torch.Tensor | np.ndarray):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), {k: v for k, v in batch.items() if k not in _TARGET_KEYS}
    inputs = batch[0]
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    return (inputs,), {}


# --- ONNX Runtime -----------------------------------------------------------------------------


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"No ONNX int8 method named {method!r}. Known: {', '.join(METHODS)}.")


def _untie_gemm_weights(model: Any) -> None:
    """Give every Gemm its own copy of a weight it shares (as ``autotune.export.onnx`` does).

    ONNX Runtime's dynamic quantizer rewrites Gemm(transB=1) as MatMul by transposing the
    weight in place, once per Gemm: a shared weight ends up transposed twice.
    """
    import collections

    import onnx

    initializers = {t.name: t for t in model.graph.initializer}
    uses = collections.Counter(name for node in model.graph.node for name in node.input if name in initializers)
    for node in model.graph.node:
        if node.op_type == "Gemm" and len(node.input) > 1 and uses[node.input[1]] > 1:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(initializers[node.input[1]])
            tensor.name = f"{node.input[1]}__{node.output[0]}"
            model.graph.initializer.append(tensor)
            uses[node.input[1]] -= 1
            node.input[1] = tensor.name
    for tensor in [t for t in model.graph.initializer if t.name in uses and uses[t.name] == 0]:
        model.graph.initializer.remove(tensor)


def _prepare(src: str | Path) -> Any:
    """The graph as every pass here sees it: shared Gemm weights untied, every node named
    (ONNX Runtime selects nodes by name; an unnamed one gets ``{op_type}_{index}``)."""
    import onnx

    try:
        model = onnx.load(str(src))
    except Exception as exc:
        raise InputError(f"Cannot read the ONNX file {src}: {type(exc).__name__}: {exc}") from exc
    _untie_gemm_weights(model)
    taken = {node.name for node in model.graph.node}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
    return model


def _quantizable(model: Any, method: str) -> list[Any]:
    """The nodes ONNX Runtime would quantize: MatMul, Gemm and Conv with float weights; for
    dynamic int8 only with a constant weight, and Gemm only in the plain form it rewrites as MatMul."""
    inits = {t.name: t for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        if node.op_type not in _LAYER_OPS or len(node.input) < 2:
            continue
        weight = inits.get(node.input[1])
        if weight is not None and weight.data_type not in _FLOAT_TYPES:
            continue
        if method == "int8_dynamic":
            attrs = {a.name: a for a in node.attribute}
            plain = all(a not in attrs or attrs[a].f == 1.0 for a in ("alpha", "beta")) and (
                "transA" not in attrs or attrs["transA"].i == 0
            )
            if weight is None or (node.op_type == "Gemm" and not plain):
                continue
        nodes.append(node)
    return nodes


def onnx_layers(path: str | Path, method: str = "int8_dynamic") -> list[str]:
    """The names of the ONNX nodes ``method`` quantizes, in graph order.

    MatMul, Gemm and Conv nodes; for ``int8_dynamic`` only those whose weight is a constant
    initializer. Unnamed nodes are named ``{op_type}_{index}`` (index in the graph's node list),
    as every function here names them.

    Raises:
        ConfigError: unknown ``method``.
        InputError: the file cannot be read.

    Example:
        >>> onnx_layers("model.onnx")  # doctest: +SKIP
        ['/encoder/layer.0/attention/self/query/MatMul', ...]
    """
    _check_method(method)
    return [node.name for node in _quantizable(_prepare(path), method)]


def _session(model: Any) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # the quantized graphs' "unused initializer" notes are noise
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


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


def _onnx_feeds(batches: list, session: Any) -> list[dict[str, np.ndarray]]:
    """Batches as feeds: positional inputs onto the graph inputs in order, keyword ones by name."""
    inputs = {i.name: _NP_TYPES.get(i.type) for i in session.get_inputs()}
    feeds = []
    for i, batch in enumerate(batches):
        args, kwargs = _model_inputs(batch)
        unknown = [k for k in kwargs if k not in inputs]
        if unknown:
            raise InputError(f"Batch {i} has inputs {unknown} the graph lacks. Graph inputs: {', '.join(inputs)}.")
        free = [n for n in inputs if n not in kwargs]
        if len(args) > len(free):
            raise InputError(f"Batch {i} has {len(args)} positional inputs, but the graph takes {len(inputs)}.")
        named = {**dict(zip(free, args, strict=False)), **kwargs}
        missing = [n for n in inputs if n not in named]
        if missing:
            raise InputError(f"Batch {i} lacks the graph inputs {', '.join(missing)}.")
        feed = {}
        for name, value in named.items():
            array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            feed[name] = array.astype(inputs[name], copy=False) if inputs[name] is not None else array
        feeds.append(feed)
    return feeds


def _run_all(session: Any, feeds: list[dict], what: str) -> list[list[np.ndarray]]:
    out = []
    for i, feed in enumerate(feeds):
        try:
            out.append(session.run(None, feed))
        except Exception as exc:
            text = " ".join(str(exc).split())[:300]
            raise InputError(f"{what} fails on calibration batch {i}: {type(exc).__name__}: {text}") from exc
    return out


def _as_output(outs: list[np.ndarray]) -> Any:
    return outs[0] if len(outs) == 1 else list(outs)


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


def _quantized_inputs(node: Any, arrays: list[list], inits: set[str], method: str, ranges: dict) -> list[list]:
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
            axis = _weight_axis(node) if method == "int8_static" else None
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
    inputs = [
        helper.make_tensor_value_info(f"in_{i}", helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for i, a in enumerate(example)
        if node.input[i]
    ]
    graph = helper.make_graph([single], "layer", inputs, [onnx.ValueInfoProto(name="out")])
    proto = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    return _session(proto.SerializeToString())


def _capture(model: Any, nodes: list[Any], feeds: list[dict]) -> list[dict[str, np.ndarray]]:
    """Per batch, every tensor the layers read or write, from one run of the float graph."""
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
    runs = _run_all(session, feeds, "The float graph")
    return [{**feed, **dict(zip(names, outs, strict=True))} for feed, outs in zip(feeds, runs, strict=True)]


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
        y_q = y_q + alpha * _saturation(a[rows], a_range, w, per_channel=static)
    if job["method"] == "int8_static":  # the QDQ quantizer quantizes the layer's output too
        y_q = _fake_quant(y_q, *job["ranges"][node.output[0]], 0, 255)
    return float(np.sum((y_q.astype(np.float64) - y) ** 2)), float(np.sum(y.astype(np.float64) ** 2))


def _cheap_onnx(model: Any, nodes: list[Any], feeds: list[dict], method: str) -> dict[str, float]:
    from onnx import numpy_helper

    captured = _capture(model, nodes, feeds)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    ranges = {}  # static int8: each activation's range over all calibration batches
    for name in {n for node in nodes for n in [*node.input, node.output[0]] if n and n not in weights}:
        ranges[name] = (min(float(c[name].min()) for c in captured), max(float(c[name].max()) for c in captured))
    job = {"method": method, "ranges": ranges, "inits": set(weights), "saturate": _u8s8_saturates()}
    errors = {}
    for node in nodes:
        arrays = [[c[n] if n in c else weights.get(n) for n in node.input] for c in captured]
        quantized = _quantized_inputs(node, arrays, set(weights), method, ranges)
        session = _node_session(node, arrays[0], model)
        num = den = 0.0
        for c, inputs, row in zip(captured, arrays, quantized, strict=True):
            y_q = session.run(None, {f"in_{i}": a for i, a in enumerate(row) if node.input[i]})[0]
            d_num, d_den = _layer_error(node, inputs, y_q, c[node.output[0]], job)
            num, den = num + d_num, den + d_den
        errors[node.name] = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return errors


class _Reader:
    """Feeds as an ONNX Runtime ``CalibrationDataReader``."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def _ort_names(model: Any, names: list[str], method: str) -> list[str]:
    """Names as the quantizer sees them: dynamic int8 rewrites Gemm ``g`` as MatMul ``g_MatMul``."""
    if method != "int8_dynamic":
        return list(names)
    gemms = {n.name for n in model.graph.node if n.op_type == "Gemm"}
    return [*names, *(f"{n}_MatMul" for n in names if n in gemms)]


def _int8_layers(quantized: Any, layers: list[str], method: str) -> list[str]:
    """The layers that run in int8 in a quantized graph."""
    if method == "int8_dynamic":
        q = {n.name for n in quantized.graph.node if n.op_type in ("MatMulInteger", "ConvInteger")}
        return [name for name in layers if f"{name}_quant" in q or f"{name}_MatMul_quant" in q]
    # QDQ: both operands dequantized. Not the first alone: a float layer may read an activation
    # that a quantized neighbour shares, which the quantizer routes through Q/DQ for every reader.
    dq = {o for n in quantized.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    by_name = {n.name: n for n in quantized.graph.node}
    return [name for name in layers if name in by_name and all(i in dq for i in by_name[name].input[:2])]


def _quantize_file(prepared: Path, dst: Path, method: str, feeds: list[dict], **select: list[str]) -> Any:
    """Run ONNX Runtime's quantizer on ``prepared`` into ``dst``: static int8 in QDQ format with
    per-channel weights, as ``autotune.export.onnx`` does, but only MatMul, Gemm and Conv (not
    Gather, say), so every int8 op is a ranked layer and keeping all of them float means float."""
    import logging

    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)  # the quantizer warns on every call that the graph was not pre-processed
    try:
        if method == "int8_dynamic":
            quantize_dynamic(
                prepared, dst, op_types_to_quantize=list(_LAYER_OPS), weight_type=QuantType.QInt8, **select
            )
        else:
            quantize_static(
                prepared, dst, _Reader(feeds), quant_format=QuantFormat.QDQ, per_channel=True,
                op_types_to_quantize=list(_LAYER_OPS), **select,
            )  # fmt: skip
    except Exception as exc:
        text = " ".join(str(exc).split())[:300]
        raise TrialError(
            "unsupported", f"ONNX Runtime could not quantize ({method}): {type(exc).__name__}: {text}"
        ) from exc
    finally:
        logger.setLevel(level)
    return onnx.load(str(dst))


class _OnnxJob:
    """One float graph, its layers and calibration feeds, and a scratch folder for quantized variants."""

    def __init__(self, src: str | Path, method: str, batches: list, workdir: Path) -> None:
        import onnx

        _check_method(method)
        _check_batches(batches)
        self.method = method
        self.model = _prepare(src)
        self.nodes = _quantizable(self.model, method)
        self.layers = [n.name for n in self.nodes]
        if not self.layers:
            what = (
                "MatMul, Gemm or Conv with a constant float weight"
                if method == "int8_dynamic"
                else "MatMul, Gemm or Conv"
            )
            raise TrialError(
                "unsupported", f"{method} found no layer to quantize in {Path(src).name}: it has no {what}."
            )
        self.prepared = workdir / "prepared.onnx"
        onnx.save(self.model, str(self.prepared))
        try:
            session = _session(str(self.prepared))
        except Exception as exc:
            text = " ".join(str(exc).split())[:300]
            raise InputError(f"ONNX Runtime cannot load {Path(src).name}: {type(exc).__name__}: {text}") from exc
        self.feeds = _onnx_feeds(list(batches), session)
        self.reference = [_as_output(o) for o in _run_all(session, self.feeds, "The float graph")]

    def quantize(self, dst: Path, *, only: list[str] | None = None, exclude: list[str] | None = None) -> list[str]:
        """Quantize ``only`` these layers, or all but ``exclude``; the layers now in int8."""
        select = {"nodes_to_quantize": _ort_names(self.model, only, self.method)} if only else {}
        select["nodes_to_exclude"] = _ort_names(self.model, exclude or [], self.method)
        quantized = _int8_layers(
            _quantize_file(self.prepared, dst, self.method, self.feeds, **select), self.layers, self.method
        )
        expected = only if only else [n for n in self.layers if n not in set(exclude or [])]
        refused = [n for n in expected if n not in quantized]
        if refused:
            raise TrialError(
                "unsupported",
                f"ONNX Runtime left {len(refused)} layer(s) float that it was asked to quantize: {refused[:5]}.",
            )
        return quantized

    def outputs(self, path: Path) -> list:
        try:
            session = _session(str(path))
        except Exception as exc:
            raise TrialError(
                "unsupported", f"The {self.method} graph does not load: {type(exc).__name__}: {exc}"
            ) from exc
        return [_as_output(o) for o in _run_all(session, self.feeds, f"The {self.method} graph")]


def rank_onnx(
    path: str | Path,
    method: str,
    batches: list,
    score: Score,
    *,
    budget_s: float | None = None,
    refine: bool | int = True,
) -> Ranking:
    """Rank an ONNX graph's quantizable layers by how much ``method`` hurts each alone.

    Cheap pass: one run of the float graph captures each layer's inputs and output; each layer's
    int8 error is emulated as ONNX Runtime quantizes (``int8_dynamic``: activations to uint8 on
    each batch's range, weights to int8 per tensor, symmetric; ``int8_static``: activations and
    outputs to uint8 on ranges over all batches, weights per channel) and measured as
    ``||y_int8 - y|| / ||y||``. On x86 CPUs without VNNI, where ONNX Runtime adds uint8 x int8 products in
    int16 pairs that saturate (MatMul, Gemm; Conv in static int8), the emulation saturates them
    too, on up to 256 rows (tokens, pixels) per batch. Exact pass: the top layers of the cheap
    ranking are quantized one at a time in the whole graph and scored with ``score``, until
    ``budget_s``.

    Args:
        path: A float ONNX file.
        method: ``"int8_dynamic"`` or ``"int8_static"``.
        batches: Calibration batches (tensors, arrays, tuples or dicts, as the export example).
        score: ``score(reference_outputs, candidate_outputs) -> float``, higher is better.
        budget_s: Seconds after which no further layer is refined (the cheap pass always runs).
        refine: ``True`` refines the top quarter of the cheap ranking (at least 4 layers),
            widened while the next layer's cheap error is within a factor of 2 of the last
            one's; an int refines that many (widened the same way); ``False`` none.

    Returns:
        A :class:`Ranking`, most sensitive first.

    Raises:
        ConfigError: unknown ``method``.
        InputError: no batches, or the float graph fails on them.
        TrialError: kind ``unsupported``: no quantizable layer, or ONNX Runtime refuses one.

    Example:
        >>> ranking = rank_onnx("model.onnx", "int8_dynamic", batches, worst_cosine)  # doctest: +SKIP
        >>> ranking.top(4)  # doctest: +SKIP
    """
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autotune-int8-") as tmp:
        job = _OnnxJob(path, method, batches, Path(tmp))
        cheap = _cheap_onnx(job.model, job.nodes, job.feeds, method)

        def measure(name: str) -> float:
            single = Path(tmp) / "single.onnx"
            job.quantize(single, only=[name])
            return score(job.reference, job.outputs(single))

        exact = _refine(_candidates(cheap, refine), measure, budget_s, start)
    return Ranking(method, "onnxruntime", _order(cheap, exact), cheap, exact, time.perf_counter() - start, len(batches))


def _check_keep(keep_float: Iterable[str], layers: list[str]) -> list[str]:
    keep = list(dict.fromkeys(keep_float))
    unknown = [n for n in keep if n not in layers]
    if unknown:
        shown = ", ".join(layers[:10]) + (f", ... ({len(layers)} in all)" if len(layers) > 10 else "")
        raise InputError(f"No quantizable layer named {unknown[0]!r}. Known: {shown}.")
    if len(keep) == len(layers):
        raise InputError(f"`keep_float` holds all {len(layers)} quantizable layers, so nothing is left to quantize.")
    return keep


def quantize_onnx_except(
    src: str | Path, dst: str | Path, method: str, keep_float: Iterable[str], calibration: list
) -> dict[str, Any]:
    """Write ``src`` with every quantizable layer in int8 except ``keep_float`` to ``dst``.

    Shared Gemm weights are untied first; ``int8_static`` writes QDQ with per-channel weights.

    Args:
        src: A float ONNX file.
        dst: The mixed file to write.
        method: ``"int8_dynamic"`` or ``"int8_static"``.
        keep_float: Layer names (from :func:`onnx_layers`) to leave float.
        calibration: Batches; ``int8_static`` calibrates on them, both methods run on them once.

    Returns:
        ``{"path", "method", "kept", "quantized", "bytes", "src_bytes"}``, ``quantized`` the
        layers now int8.

    Raises:
        InputError: an unknown name in ``keep_float``, all layers in it, or bad calibration.
        TrialError: kind ``unsupported``: no quantizable layer, or ONNX Runtime refused a layer.

    Example:
        >>> quantize_onnx_except("m.onnx", "m.int8.onnx", "int8_dynamic", ranking.top(4), batches)  # doctest: +SKIP
    """
    src, dst = Path(src), Path(dst)
    with tempfile.TemporaryDirectory(prefix="autotune-int8-") as tmp:
        job = _OnnxJob(src, method, calibration, Path(tmp))
        keep = _check_keep(keep_float, job.layers)
        dst.parent.mkdir(parents=True, exist_ok=True)
        quantized = job.quantize(dst, exclude=keep)
    return {
        "path": str(dst),
        "method": method,
        "kept": keep,
        "quantized": quantized,
        "bytes": dst.stat().st_size,
        "src_bytes": src.stat().st_size,
    }


def fallback_onnx(
    src: str | Path,
    dst: str | Path,
    method: str,
    ranking: Ranking,
    batches: list,
    score: Score,
    threshold: float,
    *,
    k: int | str = "auto",
) -> dict[str, Any]:
    """Write ``src`` in int8 with its ``k`` most sensitive layers float, the fewest that pass.

    ``k="auto"`` bisects over k in [0, n] for the fewest layers kept float (``ranking``'s top
    ones) whose graph scores ``>= threshold``; an int keeps that many.

    Returns:
        ``{"path", "kept", "k", "score", "n_layers", "threshold", "feasible", "reason",
        "tries"}``; ``tries`` is every k measured, as ``{"k", "score", "passed"}``. When only
        the float graph passes (k = n) or an explicit k fails, ``feasible`` is false and
        ``reason`` says why; ``path`` is ``None`` when nothing was written (k = n).

    Raises:
        InputError: the ranking is for another model or method, or the float graph itself
            scores below ``threshold``.
        TrialError: kind ``unsupported``: ONNX Runtime refused a layer.

    Example:
        >>> args = ("m.onnx", "m.int8.onnx", "int8_dynamic", ranking, batches, worst_cosine, 0.99)  # doctest: +SKIP
        >>> found = fallback_onnx(*args)  # doctest: +SKIP
        >>> found["kept"], found["score"]  # doctest: +SKIP
    """
    dst = Path(dst)
    with tempfile.TemporaryDirectory(prefix="autotune-int8-") as tmp:
        job = _OnnxJob(src, method, batches, Path(tmp))
        _check_ranking(ranking, "onnxruntime", method, job.layers)
        _check_float(score, job.reference, threshold)

        def try_k(j: int) -> float:
            job.quantize(Path(tmp) / f"k{j}.onnx", exclude=ranking.top(j))
            return score(job.reference, job.outputs(Path(tmp) / f"k{j}.onnx"))

        result = _outcome(_search(len(job.layers), k, threshold, try_k), job.layers, ranking, threshold)
        written = result["k"] < len(job.layers)
        if written:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / f"k{result['k']}.onnx"), dst)
    return {"path": str(dst) if written else None, **result}


# --- PyTorch dynamic int8 ---------------------------------------------------------------------


def torch_layers(model: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules PyTorch's dynamic int8 quantizes, in module order.

    Subclasses (``nn.MultiheadAttention``'s ``out_proj``, whose float weight attention reads
    directly) are left out, as ``quantize_dynamic`` with ``{nn.Linear}`` leaves them.

    Example:
        >>> torch_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        ['0', '2']
    """
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


def _cpu_outputs(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, Mapping):
        return {k: _cpu_outputs(v) for k, v in out.items()}
    if isinstance(out, tuple | list):
        return [_cpu_outputs(v) for v in out]
    return out


def _torch_outputs(model: nn.Module, batches: list, what: str) -> list:
    outs = []
    with torch.inference_mode():
        for i, batch in enumerate(batches):
            args, kwargs = _model_inputs(batch)
            try:
                outs.append(_cpu_outputs(model(*args, **kwargs)))
            except Exception as exc:
                text = " ".join(str(exc).split())[:300]
                raise InputError(f"{what} fails on calibration batch {i}: {type(exc).__name__}: {text}") from exc
    return outs


def _dynamic_int8(model: nn.Module, names: set[str]) -> nn.Module:
    """``model`` itself with the Linear modules in ``names`` swapped for dynamic int8 ones."""
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, whose CPU int8 Linear is
        # slower eagerly; autotune._quantize keeps the old path for the same reason.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        try:
            return torch.ao.quantization.quantize_dynamic(model, set(names), dtype=torch.qint8, inplace=True)
        except Exception as exc:
            text = " ".join(str(exc).split())[:300]
            raise TrialError(
                "unsupported", f"Dynamic int8 (torch.ao.quantization) failed: {type(exc).__name__}: {text}"
            ) from exc


class _WithoutFastPath(nn.Module):
    """Runs a model with the fused transformer fast path off, which only takes float weights."""

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


def _check_torch(model: nn.Module, batches: list) -> list[str]:
    _check_batches(batches)
    if torch.backends.quantized.supported_engines == ["none"]:
        raise TrialError("unsupported", "This torch build has no quantized CPU engine (fbgemm, onednn or qnnpack).")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise InputError("PyTorch dynamic int8 runs on the CPU; move the model there first (model.cpu()).")
    if model.training:
        raise InputError("The model is in training mode; call model.eval() so dropout does not blur the ranking.")
    layers = torch_layers(model)
    if not layers:
        raise TrialError("unsupported", f"int8_dynamic found no nn.Linear to quantize in {type(model).__name__}.")
    return layers


def quantize_torch_except(model: nn.Module, keep_float: Iterable[str]) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` in dynamic int8 except ``keep_float``.

    The model itself is left as it is. A model holding transformer layers comes back wrapped so
    that it runs with PyTorch's fused fast path off (it reads float weights).

    Raises:
        InputError: an unknown name in ``keep_float``, or all layers in it.
        TrialError: kind ``unsupported``: no ``nn.Linear``, or torch failed.

    Example:
        >>> q = quantize_torch_except(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval(), ["1"])
        >>> [m._get_name() for m in q]
        ['DynamicQuantizedLinear', 'Linear']
    """
    layers = torch_layers(model)
    if not layers:
        raise TrialError("unsupported", f"int8_dynamic found no nn.Linear to quantize in {type(model).__name__}.")
    keep = set(_check_keep(keep_float, layers))
    return _int8_copy(model, {n for n in layers if n not in keep})


def _int8_copy(model: nn.Module, names: set[str]) -> nn.Module:
    quantized = _dynamic_int8(copy.deepcopy(model), names)
    if any(isinstance(m, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer) for m in quantized.modules()):
        # Their fused fast path reads float weights that quantized Linears do not have.
        quantized = _WithoutFastPath(quantized)
    return quantized


def _cheap_torch(model: nn.Module, layers: list[str], batches: list) -> dict[str, float]:
    """Each Linear's relative output error when its own input and weights go through torch's
    dynamic int8 kernel (activations per tensor on each batch's range, weights per tensor)."""
    modules = dict(model.named_modules())
    seen: dict[str, list] = {name: [] for name in layers}

    def keep(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
            seen[name].append((args[0] if args else kwargs["input"], out))

        return hook

    hooks = [modules[name].register_forward_hook(keep(name), with_kwargs=True) for name in layers]
    try:
        _torch_outputs(model, batches, "The float model")
    finally:
        for hook in hooks:
            hook.remove()
    errors = {}
    with torch.inference_mode():
        for name in layers:
            single = _dynamic_int8(nn.Sequential(copy.deepcopy(modules[name])), {"0"})
            num = den = 0.0
            for x, y in seen.pop(name):
                num += float(torch.sum((single(x).double() - y.double()) ** 2))
                den += float(torch.sum(y.double() ** 2))
            errors[name] = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return errors


def rank_torch(
    model: nn.Module,
    batches: list,
    score: Score,
    *,
    budget_s: float | None = None,
    refine: bool | int = True,
) -> Ranking:
    """Rank a model's ``nn.Linear`` layers by how much PyTorch's dynamic int8 hurts each alone.

    Cheap pass: forward hooks capture every Linear's input and output on the batches; each
    Linear, quantized alone, runs on its captured inputs. Exact pass: the top layers are
    quantized one at a time in a copy of the model and scored with ``score``, until ``budget_s``.

    Args:
        model: A float model on the CPU, in eval mode; it is not changed.
        batches: Collated batches (a tensor, ``(inputs, target)``, or a dict of keyword inputs).
        score: ``score(reference_outputs, candidate_outputs) -> float``, higher is better.
        budget_s: Seconds after which no further layer is refined.
        refine: ``True``, an int, or ``False``, as in :func:`rank_onnx`.

    Raises:
        InputError: no batches, a model off the CPU or in training mode, or it fails on a batch.
        TrialError: kind ``unsupported``: no ``nn.Linear``, or torch failed to quantize one.

    Example:
        >>> ranking = rank_torch(model.eval(), batches, worst_cosine)  # doctest: +SKIP
    """
    start = time.perf_counter()
    layers = _check_torch(model, batches)
    reference = _torch_outputs(model, batches, "The float model")
    cheap = _cheap_torch(model, layers, batches)

    def measure(name: str) -> float:
        single = _int8_copy(model, {name})
        return score(reference, _torch_outputs(single, batches, "The int8 model"))

    exact = _refine(_candidates(cheap, refine), measure, budget_s, start)
    return Ranking(
        "int8_dynamic", "torch", _order(cheap, exact), cheap, exact, time.perf_counter() - start, len(batches)
    )


def fallback_torch(
    model: nn.Module,
    ranking: Ranking,
    batches: list,
    score: Score,
    threshold: float,
    *,
    k: int | str = "auto",
) -> tuple[nn.Module | None, dict[str, Any]]:
    """A dynamic int8 copy of ``model`` with its ``k`` most sensitive Linears float.

    ``k="auto"`` finds the fewest kept float that pass, as :func:`fallback_onnx` does.

    Returns:
        The mixed model (``None`` when only the float model passes, k = n) and ``{"kept", "k",
        "score", "n_layers", "threshold", "feasible", "reason", "tries"}``.

    Raises:
        InputError: the ranking is for another model, or the float model scores below ``threshold``.
        TrialError: kind ``unsupported``: torch failed to quantize.

    Example:
        >>> q, info = fallback_torch(model, ranking, batches, worst_cosine, 0.99)  # doctest: +SKIP
    """
    layers = _check_torch(model, batches)
    _check_ranking(ranking, "torch", "int8_dynamic", layers)
    reference = _torch_outputs(model, batches, "The float model")
    _check_float(score, reference, threshold)

    def try_k(j: int) -> float:
        return score(reference, _torch_outputs(quantize_torch_except(model, ranking.top(j)), batches, "The int8 model"))

    result = _outcome(_search(len(layers), k, threshold, try_k), layers, ranking, threshold)
    # Quantized again rather than kept from the search: one copy of the model alive at a time.
    chosen = quantize_torch_except(model, result["kept"]) if result["k"] < len(layers) else None
    return chosen, result
