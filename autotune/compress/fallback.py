"""INT8 with per-layer fallback inside a trial: the ``int8_fallback`` knob's work.

A trial that quantizes (torch's ``int8_dynamic``, ``int8_weight_only`` or ``int8_static``,
ONNX Runtime's ``int8_dynamic`` / ``int8_static``, or OpenVINO's NNCF ``int8_static``) with
``int8_fallback`` other than 0 ranks the model's quantizable layers by
their int8 sensitivity (:mod:`autotune.compress.sensitivity`), judged by the guard's own
criterion (the user's metric and its ``max_metric_drop``, or fidelity to the float model's
outputs, each output by its kind on real tokens, on the calibration batches, which the guard
never scores), then keeps the most sensitive float: a fixed number,
or with ``"auto"`` the fewest that pass. A ranking is computed once per method and model form
and kept: in the worker for the next trials, and in the study's user attributes the moment it
is computed (:class:`StudyRankings`), for resumed runs, other workers and a worker replaced
after a fault. The ranking's cheap pass, its refinement and ``auto``'s search each keep to the
plan's time budget.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.errors import TrialError

__all__ = [
    "Int8NoGainError",
    "Int8Plan",
    "StudyRankings",
    "ranking_key",
    "onnx_with_fallback",
    "openvino_with_fallback",
    "torch_with_fallback",
]

# What a ranking may cost by default when the plan does not say: two short trials' worth.
_DEFAULT_BUDGET_S = 60.0


class Int8NoGainError(TrialError):
    """``auto``'s verdict for speed: the whole-int8 build ran ``gain`` times the float one, under
    :data:`~autotune.compress.sensitivity.MIN_INT8_GAIN`, so no layer kept float makes it pay."""

    def __init__(self, message: str, gain: float) -> None:
        super().__init__("unsupported", message)
        self.gain = gain


def _unsupported(out: dict[str, Any]) -> TrialError:
    message = f"int8 fallback: {out['reason']}"
    return Int8NoGainError(message, out["int8_gain"]) if "int8_gain" in out else TrialError("unsupported", message)


@dataclasses.dataclass
class Int8Plan:
    """How a worker's int8 fallbacks judge and what they remember.

    Attributes:
        kinds: The kind of each output, as the guard judges it.
        max_drop: The guard's ``max_metric_drop``: on fidelity, or on ``metric`` when given.
        metric: The user's ``metric(outputs, batch)``, or ``None`` for fidelity.
        budget_s: Seconds the exact refinement of one ranking may take.
        rankings: Ranking JSON by :func:`ranking_key`: those stored in the study, and those
            computed in this worker.
        keep: Layer names to keep float, as a run recorded them (``apply`` from a run's
            ``best_config.json``): no ranking, no search.
        store: Where each ranking is written once computed and read before ranking again.
        floors: By ranking key, the fewest layers ``auto`` keeps float because the guard's own
            samples needed them (:meth:`raise_floor`), kept in ``store`` too.
        for_speed: The run optimizes speed alone: where the whole-int8 model runs no faster
            than the float one (:data:`~autotune.compress.sensitivity.MIN_INT8_GAIN`), ``auto``
            keeps no layer float to pass the guard, since none can make a faster build. A run
            that weighs size keeps searching: int8 is smaller however fast it runs.
    """

    kinds: list[str] | None = None
    max_drop: float = 0.01
    metric: Callable[[Any, Any], float] | None = None
    budget_s: float = _DEFAULT_BUDGET_S
    rankings: dict[str, str] = dataclasses.field(default_factory=dict)
    keep: list[str] | None = None
    store: StudyRankings | None = None
    floors: dict[str, int] = dataclasses.field(default_factory=dict)
    for_speed: bool = False

    def floor(self, key: str) -> int:
        """The fewest of ``key``'s ranked layers ``auto`` keeps float: 0, unless the guard
        rejected fewer on its own samples, in this worker or another of the run."""
        if self.store is not None:
            stored = self.store.get(_FLOOR + key)
            if stored is not None:
                self.floors[key] = max(self.floors.get(key, 0), int(stored))
        return self.floors.get(key, 0)

    def raise_floor(self, key: str, k: int) -> None:
        """From now on ``auto`` keeps at least ``k`` of ``key``'s ranked layers float: the
        calibration batches passed fewer, the guard's samples did not."""
        if k > self.floor(key):
            self.floors[key] = k
            if self.store is not None:
                self.store.put(_FLOOR + key, str(k))


# The prefix of a floor's key beside the rankings in a study's user attributes.
_FLOOR = "floor:"


def ranking_key(backend: str, method: str, config: Any) -> str:
    """What a ranking depends on besides the model: the runtime, the method, its weight scales
    and the pruning that changed the model's layers before quantization."""
    parts = [backend, method, f"pc={bool(config.get('int8_per_channel', False))}"]
    parts += [str(config.get(k)) for k in ("prune_ratio", "prune_method", "finetune_steps")]
    return ":".join(parts)


def _judge(plan: Int8Plan, batches: list) -> tuple[Callable[[list, list], float], float]:
    """``(score, threshold)`` on the calibration batches meaning what the guard's check means on
    the validation samples: ``score(reference, candidate) >= threshold`` where the guard's drop
    would be ``<= plan.max_drop``. ``reference`` and ``candidate`` hold one batch's outputs each
    (arrays or tensors, alone or in a tuple or dict).

    With the user's metric, the score is minus its drop, the metric averaged over the batches as
    the guard averages it, so ``max_metric_drop`` keeps the metric's own scale. With fidelity, it
    is the worst batch's fidelity against ``1 - max_drop`` (token sequences make each batch as wide
    as its own longest). Either way token-level outputs count on real tokens only (the batch's
    ``attention_mask``), as the guard counts them.
    """
    from autotune.samples import MASK_KEY, sample_inputs

    # Up a floor, kept: the guard's leaf judgement; moved down, trial/fidelity.py would be a re-export shim.
    from autotune.trial.fidelity import fidelity

    masks = [(sample_inputs(b) or {}).get(MASK_KEY) for b in batches]
    masks = [m.bool() if hasattr(m, "bool") and m.dim() == 2 else None for m in masks]
    if plan.metric is not None:
        metric = plan.metric

        def drop(reference: list, candidate: list) -> float:
            ref = [float(metric(_model_output(r), b)) for r, b in zip(reference, batches, strict=True)]
            cand = [float(metric(_model_output(c), b)) for c, b in zip(candidate, batches, strict=True)]
            return -(sum(ref) / len(ref) - sum(cand) / len(cand))

        return drop, -plan.max_drop

    def score(reference: list, candidate: list) -> float:
        pairs = zip(reference, candidate, masks, strict=True)
        return min(fidelity(_to_torch(c), _to_torch(r), plan.kinds, m) for r, c, m in pairs)

    return score, 1.0 - plan.max_drop


def _model_output(value: Any) -> Any:
    """One batch's outputs as the guard hands them to a metric: tensors, sequences as tuples."""
    value = _to_torch(value)
    if isinstance(value, dict):
        return {k: _model_output(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(_model_output(v) for v in value)
    return value


def _to_torch(value: Any) -> Any:
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float() if value.is_floating_point() else value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_torch(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_torch(v) for v in value)
    return value


class StudyRankings:
    """Rankings kept in a study's user attributes, through its storage, as soon as each is
    computed: a worker replaced after a fault, or another worker of a shared study, reads them
    there instead of ranking again (perhaps differently).

    Args:
        storage: The study's storage URL.
        study_name: The study's name in it.
    """

    PREFIX = "int8_ranking:"

    def __init__(self, storage: str, study_name: str) -> None:
        self.storage, self.study_name = storage, study_name
        self._opened: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage, "study_name": self.study_name, "_opened": None}

    def _open(self) -> tuple[Any, int]:
        if self._opened is None:
            import optuna

            storage = optuna.storages.get_storage(self.storage)
            self._opened = storage, storage.get_study_id_from_name(self.study_name)
        return self._opened

    def get(self, key: str) -> str | None:
        """The ranking stored under ``key``, or ``None``."""
        storage, study_id = self._open()
        return storage.get_study_user_attrs(study_id).get(self.PREFIX + key)

    def put(self, key: str, ranking: str) -> None:
        """Store ``ranking`` (JSON) under ``key``."""
        storage, study_id = self._open()
        storage.set_study_user_attr(study_id, self.PREFIX + key, ranking)


def _ranking(plan: Int8Plan, key: str, backend: str, method: str, rank: Callable[[], Any]) -> Any:
    """The ranking under ``key``, as a :class:`~autotune.compress.sensitivity.Deferred`, made
    when the search first names a layer to keep float: read where the plan or the study keeps
    it, else computed by ``rank`` and kept in both at once."""
    from autotune.compress.sensitivity import Deferred, Ranking

    def read() -> Any:
        if key not in plan.rankings and plan.store is not None:
            stored = plan.store.get(key)  # another worker, or this one before a fault, ranked already
            if stored is not None:
                plan.rankings[key] = stored
        return Ranking.from_json(plan.rankings[key]) if key in plan.rankings else None

    def compute() -> Any:
        ranking = rank()
        plan.rankings[key] = ranking.to_json()
        if plan.store is not None:
            plan.store.put(key, plan.rankings[key])  # now, not when the trial ends: it may not end well
        return ranking

    return Deferred(backend, method, compute, read)


def _info(out: dict[str, Any], ranking: Any, key: str) -> dict[str, Any]:
    """What the trial records: the layers kept float, each with its relative output error when it
    alone runs in int8 (measured for every layer, so one unit for all) and, for the layers the
    exact pass refined, the guard's criterion on the model's outputs with it alone in int8 (a
    metric's change, or the fidelity; 0.0 from a metric means that layer alone changed no score).
    A ranking computed here is recorded whole; none is where no layer had to stay float."""
    computed = ranking.get() if ranking.computed else None
    errors = {n: computed.cheap_error.get(n) for n in out["kept"]} if computed else {}
    scores = {n: computed.exact_score[n] for n in out["kept"] if n in computed.exact_score} if computed else {}
    info = {
        "int8_kept": list(out["kept"]),
        "int8_kept_error": json.dumps(errors),
        "int8_kept_score": json.dumps(scores),
        "int8_k": out["k"],
        "int8_layers": out["n_layers"],
        "int8_fallback_score": out["score"],
        "int8_key": key,
    }
    if computed is not None and ranking.fresh:
        info.update(int8_ranking=computed.to_json(), int8_ranking_key=key, int8_ranking_s=computed.cost_s)
    return info


def onnx_with_fallback(
    src: Path, dst: Path, method: str, value: Any, calibration: list, plan: Int8Plan | None, config: Any
) -> dict[str, Any]:
    """Write ``src`` quantized by ONNX Runtime's ``method`` to ``dst`` with the ``value`` most
    sensitive layers kept float (``"auto"``: the fewest that keep the guard (:func:`_judge`)).

    Returns:
        The trial's record of it (:func:`_info`).

    Raises:
        TrialError: ``unsupported`` when no layer quantizes or only the float model passes.
    """
    from autotune.compress.sensitivity_onnx import fallback_onnx, quantize_onnx_except, rank_onnx

    plan = plan or Int8Plan()
    per_channel = bool(config.get("int8_per_channel", False))
    if plan.keep is not None:
        quantize_onnx_except(src, dst, method, plan.keep, calibration, per_channel=per_channel)
        return {"int8_kept": list(plan.keep)}
    score, threshold = _judge(plan, calibration)
    key = ranking_key("onnxruntime", method, config)
    ranking = _ranking(
        plan, key, "onnxruntime", method,
        lambda: rank_onnx(src, method, calibration, score, budget_s=plan.budget_s, per_channel=per_channel),
    )  # fmt: skip
    out = fallback_onnx(
        src, dst, method, ranking, calibration, score, threshold, k=value, per_channel=per_channel,
        budget_s=plan.budget_s, floor=plan.floor(key), check_gain=plan.for_speed,
    )  # fmt: skip
    if not out["feasible"]:
        raise _unsupported(out)
    return _info(out, ranking, key)


def torch_with_fallback(
    model: Any, method: str, value: Any, calibration: list, plan: Int8Plan | None, config: Any
) -> tuple[Any, dict]:
    """``model`` with torch's ``method`` int8 on every layer it takes but the ``value`` most
    sensitive (``"auto"``: the fewest that keep the guard (:func:`_judge`)).

    Raises:
        TrialError: ``unsupported`` when no layer quantizes or only the float model passes.
    """
    from autotune.compress.sensitivity_torch import fallback_torch, quantize_torch_except, rank_torch

    plan = plan or Int8Plan()
    per_channel = bool(config.get("int8_per_channel", False))
    if plan.keep is not None:
        kept = quantize_torch_except(model, plan.keep, method, calibration=calibration, per_channel=per_channel)
        return kept, {"int8_kept": list(plan.keep)}
    score, threshold = _judge(plan, calibration)
    key = ranking_key("torch", method, config)
    ranking = _ranking(
        plan, key, "torch", method,
        lambda: rank_torch(model, calibration, score, budget_s=plan.budget_s, method=method, per_channel=per_channel),
    )  # fmt: skip
    quantized, out = fallback_torch(
        model, ranking, calibration, score, threshold, k=value, per_channel=per_channel, budget_s=plan.budget_s,
        floor=plan.floor(key), check_gain=plan.for_speed,
    )  # fmt: skip
    if quantized is None or not out["feasible"]:
        raise _unsupported(out)
    return quantized, _info(out, ranking, key)


def openvino_with_fallback(
    float_model: Any, value: Any, calibration: list, feeds: list, plan: Int8Plan | None, config: Any, transformer: bool
) -> tuple[Any, dict[str, Any]]:
    """``float_model`` (an ``openvino.Model``) in NNCF's static int8 with the ``value`` layers it
    hurts most kept float (``"auto"``: the fewest that keep the guard (:func:`_judge`)), each kept
    layer in NNCF's ``IgnoredScope``. ``calibration`` holds the collated batches (what the guard's
    criterion reads: targets, the attention mask), ``feeds`` the same batches as the model's inputs.

    Returns:
        ``(int8 model, the trial's record of it)`` (:func:`_info`).

    Raises:
        TrialError: ``unsupported`` when NNCF quantizes no layer or only the float model passes.
    """
    from autotune.compress.sensitivity_ov import fallback_openvino, rank_openvino
    from autotune.export.openvino import quantize_openvino

    plan = plan or Int8Plan()
    if plan.keep is not None:  # a run's own layers (apply): NNCF's ignored scope, no ranking
        kept = quantize_openvino(float_model, feeds, ignored=plan.keep, transformer=transformer)
        return kept, {"int8_kept": list(plan.keep)}
    quantized = quantize_openvino(float_model, feeds, transformer=transformer)
    score, threshold = _judge(plan, calibration)
    key = ranking_key("openvino", "int8_static", config)
    ranking = _ranking(
        plan,
        key,
        "openvino",
        "int8_static",
        lambda: rank_openvino(float_model, quantized, feeds, budget_s=plan.budget_s),
    )
    model, out = fallback_openvino(
        float_model, quantized, ranking, feeds, score, threshold, k=value, transformer=transformer,
        budget_s=plan.budget_s, floor=plan.floor(key), check_gain=plan.for_speed,
    )  # fmt: skip
    if model is None or not out["feasible"]:
        raise _unsupported(out)
    return model, _info(out, ranking, key)
