"""INT8 that holds accuracy: rank layers by how much int8 hurts them, keep the worst float.

Quantizing every layer of a model to int8 can ruin it while quantizing all but a few keeps
almost all the speed: one layer whose input has an outlier channel loses everything to a
per-tensor activation scale. This module ranks the quantizable layers (ONNX Runtime dynamic or
static int8; PyTorch dynamic, weight-only and static int8), then finds the fewest of the most sensitive ones to keep in
float so that a caller's criterion holds.

Ranking has two passes. The cheap one runs the float model batch by batch and, as each layer is
called, measures the relative error int8 causes at that layer alone (``||y_int8 - y|| / ||y||``),
emulating the int8 arithmetic as the runtime does it on this CPU; nothing is kept from one call
to the next (ONNX Runtime: from one batch to the next), and it stops when its budget is spent.
The exact one quantizes a single layer of the whole model and scores the model's outputs with
the caller's criterion; it runs only for the layers the cheap pass puts at the top, within a
time budget.

A criterion (``score``) takes the float model's outputs and a candidate's, one entry per
calibration batch, and returns a number where higher is better; a candidate passes when
``score >= threshold``. :func:`worst_cosine` and :func:`max_rel_error` are two such criteria.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from autotune.compress.int8_gain import MIN_INT8_GAIN, speed_ratio
from autotune.errors import ConfigError, InputError

__all__ = ["METHODS", "MIN_INT8_GAIN", "Deferred", "Ranking", "Score", "max_rel_error", "speed_ratio", "worst_cosine"]

Score = Callable[[list, list], float]

METHODS = ("int8_dynamic", "int8_static")
_BACKENDS = {
    "onnxruntime": METHODS,
    "torch": ("int8_dynamic", "int8_weight_only", "int8_static"),
    "openvino": ("int8_static",),  # NNCF's static int8 (autotune.compress.sensitivity_ov)
}
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
        backend: ``"onnxruntime"``, ``"torch"`` or ``"openvino"``.
        layers: Layer names (ONNX node names, module names, or OpenVINO op names), most sensitive first.
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


class Deferred:
    """A ranking made the first time a search names a layer to keep float: ``auto``, whose first
    try keeps none, never ranks where every layer in int8 already passes (ranking real MiniLM in
    OpenVINO took 5.9 s of a 33-s first int8 trial whose int8 model passed whole).

    Args:
        backend, method: What the ranking is for (checked against the searched model at once).
        compute: Ranks the layers.
        read: Returns a ranking kept from before (a worker's, a study's), or ``None``; tried first.

    Attributes:
        fresh: Whether ``compute`` made the ranking here (not read where it was kept).

    Example:
        >>> lazy = Deferred("torch", "int8_dynamic", lambda: 1 / 0)
        >>> lazy.top(0), lazy.computed
        ([], False)
    """

    def __init__(
        self,
        backend: str,
        method: str,
        compute: Callable[[], Ranking],
        read: Callable[[], Ranking | None] | None = None,
    ) -> None:
        self.backend, self.method = backend, method
        self._compute, self._read = compute, read
        self._ranking: Ranking | None = None
        self._layers: list[str] | None = None
        self.fresh = False

    @property
    def computed(self) -> bool:
        """Whether :meth:`get` ran: some layer had to be named."""
        return self._ranking is not None

    def expect(self, layers: list[str]) -> None:
        """Check the ranking against ``layers`` (the searched model's) once there is one."""
        self._layers = list(layers)
        if self._ranking is not None:
            _check_ranking(self._ranking, self.backend, self.method, self._layers)

    def get(self) -> Ranking:
        """The ranking: on the first call read, or else computed."""
        if self._ranking is None:
            ranking = self._read() if self._read is not None else None
            if ranking is None:
                ranking, self.fresh = self._compute(), True
            if self._layers is not None:
                _check_ranking(ranking, self.backend, self.method, self._layers)
            self._ranking = ranking
        return self._ranking

    def top(self, k: int) -> list[str]:
        """The ``k`` most sensitive layers; ``k = 0`` reads and computes nothing."""
        return [] if k <= 0 else self.get().top(k)


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


def _search(
    n: int,
    k: int | str,
    threshold: float,
    try_k: Callable[[int], float],
    deadline: float | None = None,
    floor: int = 0,
    gain: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """The number of most sensitive layers to keep float: ``k`` itself (at most ``n``), or the fewest that pass.

    ``"auto"`` bisects k over [``floor``, n] (``floor``: the fewest that the guard's own samples
    were seen to need, :meth:`autotune.compress.fallback.Int8Plan.floor`) assuming that keeping more layers float never scores lower;
    k = n (the float model) passes by the caller's check. The result's ``tries`` hold k and k - 1
    measured, the first passing and the second not, which is the bisection's invariant. Past
    ``deadline`` (a ``time.perf_counter()`` value) it stops at the fewest measured to pass
    (``"stopped"`` in the result). Where ``floor`` fails, ``gain`` (the whole-int8 model's speed
    over the float one's, :func:`speed_ratio`) is asked first: under :data:`MIN_INT8_GAIN`, no
    layer kept float can make a faster build, and ``auto`` ends there (``"gain"`` in the result)
    before the ranking and the bisection spend their time.

    Example:
        >>> _search(8, "auto", 0.5, lambda j: j / 10)["k"]  # 5 kept float score 0.5
        5
        >>> _search(8, "auto", 0.5, lambda j: j / 10, gain=lambda: 0.95)  # int8 no faster: no bisection
        {'k': 8, 'tries': [{'k': 0, 'score': 0.0, 'passed': False}], 'gain': 0.95}
    """
    tries: list[dict[str, Any]] = []

    def passes(j: int) -> bool:
        s = float(try_k(j))
        tries.append({"k": j, "score": s, "passed": s >= threshold})
        return s >= threshold

    if k != "auto":
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"`k` must be 'auto' or an int >= 0, but got {k!r}.")
        k = min(k, n)  # more layers than the model has: all of them, the float model (infeasible, not an error)
        if k < n:
            passes(k)
        return {"k": k, "tries": tries, "asked": k}
    floor = max(0, min(int(floor), n))
    if floor == n or passes(floor):
        return {"k": floor, "tries": tries}
    ratio = None if gain is None else float(gain())
    if ratio is not None and ratio < MIN_INT8_GAIN:
        return {"k": n, "tries": tries, "gain": ratio}
    lo, hi = floor, n  # lo fails, hi passes
    while hi - lo > 1:
        if deadline is not None and time.perf_counter() >= deadline:
            return {"k": hi, "tries": tries, "stopped": True}
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return {"k": hi, "tries": tries}


def _outcome(found: dict[str, Any], layers: list[str], ranking: Ranking | Deferred, threshold: float) -> dict[str, Any]:
    k, n = found["k"], len(layers)
    measured = {t["k"]: t for t in found["tries"]}
    # int8 does not pay: all float, no ranking to compute (9 s of a 33-s int8 trial).
    unranked = "gain" in found and isinstance(ranking, Deferred) and not ranking.computed
    result = {
        "kept": list(layers) if unranked else ranking.top(k),
        "k": k,
        "score": measured[k]["score"] if k in measured else None,
        "n_layers": n,
        "threshold": threshold,
        "feasible": k < n and measured[k]["passed"],
        "reason": None,
        "tries": found["tries"],
    }
    if "gain" in found:
        result["int8_gain"] = found["gain"]
        result["reason"] = (
            f"int8 does not pay here: the whole-int8 model ran {found['gain']:.2f}x the float one on the "
            f"calibration batches (under {MIN_INT8_GAIN:.2f}x), so no layer kept float makes a faster build"
            f" (keeping {found['tries'][-1]['k']} float scores {found['tries'][-1]['score']:.6g} < {threshold:.6g})"
        )
        return result
    if k == n and found.get("stopped"):
        tried = max((t for t in found["tries"] if not t["passed"]), key=lambda t: t["k"])
        result["reason"] = (
            f"auto's time budget ran out before an int8 candidate held the guard (keeping {tried['k']} of "
            f"{n} layers float scores {tried['score']:.6g} < {threshold:.6g}; the float model passes)"
        )
        return result
    if k == n and "asked" in found:
        result["reason"] = f"keeping {k} layers float leaves none of the {n} quantizable layers in int8"
    elif k == n:
        result["reason"] = (
            f"only the float model passes: every one of the {n} layers would stay float, so no int8 at all"
        )
        if n - 1 in measured:
            result["reason"] += f" (keeping {n - 1} float scores {measured[n - 1]['score']:.6g} < {threshold:.6g})"
    elif not result["feasible"]:
        result["reason"] = f"keeping {k} layers float scores {result['score']:.6g} < {threshold:.6g}"
    if found.get("stopped"):
        result["reason"] = (result["reason"] or f"kept {k} float") + " (auto stopped at its time budget)"
    return result


def _check_ranking(ranking: Ranking | Deferred, backend: str, method: str, layers: list[str]) -> None:
    if ranking.backend != backend or ranking.method != method:
        raise InputError(
            f"The ranking is for {ranking.backend} {ranking.method}, but this is {backend} {method}; rank again."
        )
    if isinstance(ranking, Deferred):
        ranking.expect(layers)  # its layers are checked when it is computed
    elif set(ranking.layers) != set(layers):
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


def _check_keep(keep_float: Iterable[str], layers: list[str]) -> list[str]:
    keep = list(dict.fromkeys(keep_float))
    unknown = [n for n in keep if n not in layers]
    if unknown:
        shown = ", ".join(layers[:10]) + (f", ... ({len(layers)} in all)" if len(layers) > 10 else "")
        raise InputError(f"No quantizable layer named {unknown[0]!r}. Known: {shown}.")
    if len(keep) == len(layers):
        raise InputError(f"`keep_float` holds all {len(layers)} quantizable layers, so nothing is left to quantize.")
    return keep
