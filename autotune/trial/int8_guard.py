"""The guard's word on an int8 build: its value on the validation samples and, where ``auto``'s
layers kept float passed the calibration batches but not the guard, more of them kept float.

``int8_fallback="auto"`` keeps float the fewest of the ranked layers that pass on calibration
batches, which the guard never scores. On real text the guard then rejected an OpenVINO int8
build that ran three times the float one by 0.003 of fidelity, and the lever was lost. Here such a
build keeps 1, 2, 4, ... more layers float until the guard holds on its own samples, the whole
model would be float, the build can no longer lead (it ran under the best so far with fewer kept),
or the ranking's time budget is spent. The layers found are the floor ``auto`` starts from in
every later build of the run (:meth:`autotune.compress.fallback.Int8Plan.raise_floor`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from autotune.config import values_of
from autotune.errors import TrialError
from autotune.trial.guard import check_finite, collect_outputs, evaluate

__all__ = ["guard_value", "keep_more_float"]


def guard_value(ctx: Any, state: Any) -> float:
    """The guard's value of ``state`` on the validation samples (the user's metric, or fidelity to
    the baseline's outputs): what the trial's ``metric`` records."""
    samples = ctx.samples_for(state)  # read as the configuration's loader reads them
    outputs = collect_outputs(state, samples)
    check_finite(outputs)
    ref = ctx.reference
    return evaluate(
        outputs, samples, ref.chunk, ctx.spec.device, ctx.spec.metric, ref.outputs, ref.kinds, ref.mask,
        collate=ctx.extras.collate_fn, tokens=ctx.extras.token_outputs,
    )  # fmt: skip


def _short(ctx: Any, config: dict[str, Any], result: dict[str, Any]) -> bool:
    """An ``auto`` int8 build that missed the guard with layers left to keep float."""
    return (
        values_of(config).int8_fallback == "auto"
        and ctx.extras.int8 is not None
        and "int8_key" in result
        and result.get("int8_k", 0) < result.get("int8_layers", 0) - 1
        and result["metric_drop"] > ctx.spec.max_metric_drop + 1e-12
    )


def keep_more_float(ctx: Any, config: dict[str, Any], result: dict[str, Any]) -> Any:
    """Where ``result`` (an ``auto`` int8 build) missed the guard: the build with more of its
    ranked layers float that holds it, or ``None`` (none did, or none was tried). Every try is in
    ``result["int8_guard_tries"]`` (JSON: k, the drop, or the error that ended the search)."""
    if not _short(ctx, config, result):
        return None
    best = (ctx.fidelity or {}).get("best")
    if best and result.get("samples_per_s", 0.0) < best:
        return None  # slower than the best so far with fewer layers float: more float cannot lead
    plan, key, n = ctx.extras.int8, result["int8_key"], result["int8_layers"]
    deadline = time.perf_counter() + plan.budget_s
    tries = [{"k": result["int8_k"], "metric_drop": result["metric_drop"]}]

    def holds(j: int) -> Any:
        plan.floors[key] = j  # this build's start; the run's floor is raised once the search ends
        try:
            state = ctx.build(config)
        except TrialError as exc:  # this many float no longer builds (or passes calibration): the trial stands
            tries.append({"k": j, "error": str(exc)})
            return False
        drop = ctx.reference.metric - guard_value(ctx, state)
        tries.append({"k": state.info.get("int8_k", j), "metric_drop": drop})
        return state if drop <= ctx.spec.max_metric_drop + 1e-12 else None

    # 1, 2, 4, ... more layers float (at most all but one) until the guard holds, then halve
    # the gap to the last that did not: the fewest found, each layer kept float costs speed.
    lo, hi, found, step = result["int8_k"], None, None, 1
    while hi is None and lo < n - 1 and time.perf_counter() < deadline:
        j = min(lo + step, n - 1)
        state = holds(j)
        if state is False:
            break
        if state is None:
            lo, step = j, step * 2
        else:
            hi, found = j, state
    while hi is not None and hi - lo > 1 and time.perf_counter() < deadline:
        j = (lo + hi) // 2
        state = holds(j)
        if state is False:
            break
        if state is None:
            lo = j
        else:
            hi, found = j, state
    plan.floors.pop(key, None)
    plan.raise_floor(key, hi if hi is not None else lo + 1)  # later builds of the run start there
    result["int8_guard_tries"] = json.dumps(tries)
    return found
