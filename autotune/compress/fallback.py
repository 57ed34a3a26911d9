"""INT8 with per-layer fallback inside a trial: the ``int8_fallback`` knob's work.

A trial that quantizes (torch's ``int8_dynamic``, ``int8_weight_only`` or ``int8_static``, or
ONNX Runtime's ``int8_dynamic`` / ``int8_static``) with ``int8_fallback`` other than 0 ranks the model's quantizable layers by
their int8 sensitivity (:mod:`autotune.compress.sensitivity`), judged by the guard's own
criterion (fidelity to the float model's outputs, each output by its kind, on the calibration
batches, which the guard never scores), then keeps the most sensitive float: a fixed number,
or with ``"auto"`` the fewest that pass. A ranking is computed once per method and model form
and kept: in the worker for the next trials, and in the study (the trial's ``int8_ranking``) for
resumed runs and other workers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.errors import TrialError

__all__ = ["Int8Plan", "ranking_key", "onnx_with_fallback", "torch_with_fallback"]

# What a ranking may cost by default when the plan does not say: two short trials' worth.
_DEFAULT_BUDGET_S = 60.0


@dataclasses.dataclass
class Int8Plan:
    """How a worker's int8 fallbacks judge and what they remember.

    Attributes:
        kinds: The kind of each output, as the guard judges it.
        threshold: The fidelity a quantized model must keep (``1 - max_metric_drop``).
        budget_s: Seconds the exact refinement of one ranking may take.
        rankings: Ranking JSON by :func:`ranking_key`: those stored in the study, and those
            computed in this worker.
        keep: Layer names to keep float, as a run recorded them (``apply`` from a run's
            ``best_config.json``): no ranking, no search.
    """

    kinds: list[str] | None = None
    threshold: float = 0.99
    budget_s: float = _DEFAULT_BUDGET_S
    rankings: dict[str, str] = dataclasses.field(default_factory=dict)
    keep: list[str] | None = None


def ranking_key(backend: str, method: str, config: Any) -> str:
    """What a ranking depends on besides the model: the runtime, the method, its weight scales
    and the pruning that changed the model's layers before quantization."""
    parts = [backend, method, f"pc={bool(config.get('int8_per_channel', False))}"]
    parts += [str(config.get(k)) for k in ("prune_ratio", "prune_method", "finetune_steps")]
    return ":".join(parts)


def _score(kinds: list[str] | None) -> Callable[[list, list], float]:
    """The guard's fidelity over all calibration batches: ``score(reference, candidate)``, each a
    list of one batch's outputs (arrays or tensors, alone or in a tuple or dict)."""
    from autotune.trial.fidelity import fidelity

    def score(reference: list, candidate: list) -> float:
        # Batch by batch (token sequences make each batch as wide as its own longest), the worst
        # batch deciding, as the worst output does.
        return min(fidelity(_to_torch(c), _to_torch(r), kinds) for r, c in zip(reference, candidate, strict=True))

    return score


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


def _ranking(plan: Int8Plan, key: str, rank: Callable[[], Any]) -> tuple[Any, bool]:
    from autotune.compress.sensitivity import Ranking

    if key in plan.rankings:
        return Ranking.from_json(plan.rankings[key]), False
    ranking = rank()
    plan.rankings[key] = ranking.to_json()
    return ranking, True


def _info(out: dict[str, Any], ranking: Any, key: str, fresh: bool) -> dict[str, Any]:
    """What the trial records: the layers kept float, each with its measured int8 error."""
    errors = {n: ranking.exact_score.get(n, ranking.cheap_error.get(n)) for n in out["kept"]}
    info = {
        "int8_kept": list(out["kept"]),
        "int8_kept_error": json.dumps(errors),
        "int8_k": out["k"],
        "int8_layers": out["n_layers"],
        "int8_fallback_score": out["score"],
    }
    if fresh:
        info.update(int8_ranking=ranking.to_json(), int8_ranking_key=key, int8_ranking_s=ranking.cost_s)
    return info


def onnx_with_fallback(
    src: Path, dst: Path, method: str, value: Any, calibration: list, plan: Int8Plan | None, config: Any
) -> dict[str, Any]:
    """Write ``src`` quantized by ONNX Runtime's ``method`` to ``dst`` with the ``value`` most
    sensitive layers kept float (``"auto"``: the fewest that keep ``plan.threshold``).

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
    score = _score(plan.kinds)
    key = ranking_key("onnxruntime", method, config)
    ranking, fresh = _ranking(
        plan, key, lambda: rank_onnx(src, method, calibration, score, budget_s=plan.budget_s, per_channel=per_channel)
    )
    out = fallback_onnx(src, dst, method, ranking, calibration, score, plan.threshold, k=value, per_channel=per_channel)
    if not out["feasible"]:
        raise TrialError("unsupported", f"int8 fallback: {out['reason']}")
    return _info(out, ranking, key, fresh)


def torch_with_fallback(
    model: Any, method: str, value: Any, calibration: list, plan: Int8Plan | None, config: Any
) -> tuple[Any, dict]:
    """``model`` with torch's ``method`` int8 on every layer it takes but the ``value`` most
    sensitive (``"auto"``: the fewest that keep ``plan.threshold``).

    Raises:
        TrialError: ``unsupported`` when no layer quantizes or only the float model passes.
    """
    from autotune.compress.sensitivity_torch import fallback_torch, quantize_torch_except, rank_torch

    plan = plan or Int8Plan()
    per_channel = bool(config.get("int8_per_channel", False))
    if plan.keep is not None:
        kept = quantize_torch_except(model, plan.keep, method, calibration=calibration, per_channel=per_channel)
        return kept, {"int8_kept": list(plan.keep)}
    score = _score(plan.kinds)
    key = ranking_key("torch", method, config)
    ranking, fresh = _ranking(
        plan,
        key,
        lambda: rank_torch(model, calibration, score, budget_s=plan.budget_s, method=method, per_channel=per_channel),
    )
    quantized, out = fallback_torch(
        model, ranking, calibration, score, plan.threshold, k=value, per_channel=per_channel
    )
    if quantized is None or not out["feasible"]:
        raise TrialError("unsupported", f"int8 fallback: {out['reason']}")
    return quantized, _info(out, ranking, key, fresh)
