"""INT8 sensitivity and fallback for ONNX Runtime: rank a graph's MatMul, Gemm and Conv nodes,
and quantize all but the most sensitive (``nodes_to_exclude``)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autotune.compress.int8_emulation import _cheap_onnx, _run_all, _session
from autotune.compress.int8_gain import gain_batches
from autotune.compress.sensitivity import (  # noqa: F401
    _BACKENDS,
    _FLOAT_TYPES,
    _LAYER_OPS,
    _TARGET_KEYS,
    METHODS,
    Deferred,
    Ranking,
    Score,
    _candidates,
    _check_batches,
    _check_float,
    _check_keep,
    _check_ranking,
    _model_inputs,
    _order,
    _outcome,
    _refine,
    _search,
    speed_ratio,
)
from autotune.errors import ConfigError, InputError, TrialError
from autotune.export.onnx import _NP_TYPES

__all__ = ["fallback_onnx", "onnx_layers", "quantize_onnx_except", "rank_onnx"]


# --- ONNX Runtime -----------------------------------------------------------------------------


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"No ONNX int8 method named {method!r}. Known: {', '.join(METHODS)}.")


def _prepare(src: str | Path) -> Any:
    """The graph as every pass here sees it: shared Gemm weights untied, every node named
    (ONNX Runtime selects nodes by name; an unnamed one gets ``{op_type}_{index}``)."""
    import onnx

    try:
        model = onnx.load(str(src))
    except Exception as exc:
        raise InputError(f"Cannot read the ONNX file {src}: {type(exc).__name__}: {exc}") from exc
    from autotune.export.onnx import _untie_gemm_weights  # as the project's own int8 export does

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


def _as_output(outs: list[np.ndarray]) -> Any:
    return outs[0] if len(outs) == 1 else list(outs)


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


def _quantize_file(
    prepared: Path, dst: Path, method: str, feeds: list[dict], per_channel: bool, **select: list[str]
) -> Any:
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
                prepared, dst, op_types_to_quantize=list(_LAYER_OPS), weight_type=QuantType.QInt8,
                per_channel=per_channel, **select,
            )  # fmt: skip
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

    def __init__(self, src: str | Path, method: str, batches: list, workdir: Path, per_channel: bool = False) -> None:
        import onnx

        _check_method(method)
        _check_batches(batches)
        self.method = method
        self.per_channel = per_channel or method == "int8_static"
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
            _quantize_file(self.prepared, dst, self.method, self.feeds, self.per_channel, **select),
            self.layers,
            self.method,
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
    per_channel: bool = False,
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
        per_channel: ``int8_dynamic`` with per-channel weights, emulated and measured so.

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
        job = _OnnxJob(path, method, batches, Path(tmp), per_channel)
        deadline = None if budget_s is None else start + budget_s
        cheap, used = _cheap_onnx(
            job.model, job.nodes, job.feeds, method, per_channel=job.per_channel, deadline=deadline
        )

        def measure(name: str) -> float:
            single = Path(tmp) / "single.onnx"
            job.quantize(single, only=[name])
            return score(job.reference, job.outputs(single))

        exact = _refine(_candidates(cheap, refine), measure, budget_s, start)
    return Ranking(method, "onnxruntime", _order(cheap, exact), cheap, exact, time.perf_counter() - start, used)


def quantize_onnx_except(
    src: str | Path,
    dst: str | Path,
    method: str,
    keep_float: Iterable[str],
    calibration: list,
    *,
    per_channel: bool = False,
) -> dict[str, Any]:
    """Write ``src`` with every quantizable layer in int8 except ``keep_float`` to ``dst``.

    Shared Gemm weights are untied first; ``int8_static`` writes QDQ with per-channel weights.

    Args:
        src: A float ONNX file.
        dst: The mixed file to write.
        method: ``"int8_dynamic"`` or ``"int8_static"``.
        keep_float: Layer names (from :func:`onnx_layers`) to leave float.
        calibration: Batches; ``int8_static`` calibrates on them, both methods run on them once.
        per_channel: ``int8_dynamic`` with per-channel weights.

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
        job = _OnnxJob(src, method, calibration, Path(tmp), per_channel)
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
    ranking: Ranking | Deferred,
    batches: list,
    score: Score,
    threshold: float,
    *,
    k: int | str = "auto",
    per_channel: bool = False,
    budget_s: float | None = None,
    floor: int = 0,
    check_gain: bool = False,
) -> dict[str, Any]:
    """Write ``src`` in int8 with its ``k`` most sensitive layers float, the fewest that pass.

    ``k="auto"`` bisects over k in [0, n] for the fewest layers kept float (``ranking``'s top
    ones) whose graph scores ``>= threshold``; an int keeps that many. With ``check_gain``, where
    the whole-int8 graph misses the guard, ``auto`` first times it against the float one and
    stops where int8 does not pay (:func:`~autotune.compress.sensitivity._search`).

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
        job = _OnnxJob(src, method, batches, Path(tmp), per_channel)
        _check_ranking(ranking, "onnxruntime", method, job.layers)
        _check_float(score, job.reference, threshold)

        def try_k(j: int) -> float:
            job.quantize(Path(tmp) / f"k{j}.onnx", exclude=ranking.top(j))
            return score(job.reference, job.outputs(Path(tmp) / f"k{j}.onnx"))

        def gain() -> float:
            whole = Path(tmp) / "k0.onnx"
            if not whole.is_file():
                job.quantize(whole, exclude=[])
            sessions = [_session(str(job.prepared)), _session(str(whole))]
            timed = gain_batches(job.feeds)
            return speed_ratio(*(lambda s=s: _run_all(s, timed, "The graph") for s in sessions))

        deadline = None if budget_s is None else time.perf_counter() + budget_s
        found = _search(len(job.layers), k, threshold, try_k, deadline, floor, gain=gain if check_gain else None)
        result = _outcome(found, job.layers, ranking, threshold)
        written = result["k"] < len(job.layers)
        if written:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / f"k{result['k']}.onnx"), dst)
    return {"path": str(dst) if written else None, **result}
