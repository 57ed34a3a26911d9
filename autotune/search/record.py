"""The study's record: what a trial stores (its result as user attributes, read back as one
flat dict), what one read of the study says (results by key, claims in flight, the budget
used), how a result is told to Optuna, and what earlier results rule out before a trial runs.

:mod:`autotune.search.study` says how workers share the study through this record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import values_of
from autotune.errors import TrialError
from autotune.search.select import OBJECTIVES
from autotune.trial.spec import TrialResult

# Statuses that say nothing about a configuration: it may be measured again.
_NO_RESULT = ("skipped", "interrupted")


def _has_result(attrs: Mapping[str, Any]) -> bool:
    """Whether a finished trial holds a result for its configuration: not a skipped or
    interrupted claim, nor one not started for the deadline (a resumed run measures it)."""
    if attrs.get("status", "skipped") in _NO_RESULT:
        return False
    return not (attrs.get("kind") == "deadline" and not attrs.get("ran"))


def n_measured(study: optuna.Study) -> int:
    """Trials of ``study`` measured so far: what counts against ``n_trials``."""
    return _View(study.get_trials(deepcopy=False), "").n_measured


def _finished(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and "status" in t.user_attrs]


class _View:
    """What one read of the study says: results by key, claims in flight, the budget used."""

    def __init__(self, trials: list[FrozenTrial], baseline_key: str) -> None:
        self.results: dict[str, FrozenTrial] = {}  # key -> earliest trial with a result
        self.claims: list[FrozenTrial] = []  # RUNNING trials holding a key
        self.n_measured = 0
        self.baseline_queued = False
        for t in trials:  # in trial-number order
            attrs = t.user_attrs
            if t.state == TrialState.RUNNING and "key" in attrs:
                self.claims.append(t)
            elif t.state in (TrialState.WAITING, TrialState.RUNNING) and attrs.get("baseline"):
                self.baseline_queued = True  # queued, or asked and about to claim
            elif t.state.is_finished() and _has_result(attrs) and "key" in attrs:
                self.results.setdefault(attrs["key"], t)
                self.n_measured += bool(attrs.get("ran") and attrs.get("repeat_of") is None)
        base = self.results.get(baseline_key)
        self.baseline = base
        self.needs_baseline = (
            base is None
            and not self.baseline_queued
            and not any(c.user_attrs["key"] == baseline_key for c in self.claims)
        )

    def raise_if_baseline_failed(self) -> None:
        base = self.baseline
        if base is not None and base.user_attrs.get("ran") and base.user_attrs.get("status") != "ok":
            attrs = base.user_attrs
            raise TrialError(
                attrs.get("kind") or attrs["status"],
                f"The baseline (the model as given) failed in trial {base.number}, so nothing can be compared "
                f"with it: {attrs['status']}: {attrs.get('reason')}. Fix the model (or raise trial_timeout if "
                "it is just slow) and start a new study: another --study name or --out directory.",
            )


# What the configuration itself caused: the sampler should learn from it. (Not what befell the
# trial: a skipped claim, an interruption, a dead worker's retry.)
_BAD_CONFIG = frozenset({"error", "oom", "timeout", "crash", "infeasible"})


def _tell(
    study: optuna.Study,
    trial: optuna.Trial,
    outcome: TrialResult,
    objectives: list[str],
    max_drop: float,
    written: Mapping[str, Any] | None = None,
) -> FrozenTrial:
    """Store ``outcome`` as user attributes (but those in ``written``, stored already) and tell."""
    drop = outcome.metrics.get("metric_drop", 0.0)
    if outcome.ok and drop > max_drop + 1e-12:
        outcome.fail("infeasible", "guard", f"metric dropped by {drop:.4g}, more than max_metric_drop={max_drop:g}")
    result = outcome.to_attrs()
    written = written or {}
    for key, value in result.items():
        if key not in written or written[key] != value:  # each attribute is one database commit
            trial.set_user_attr(key, value)
    keys = [OBJECTIVES[o][0] for o in objectives]
    if result["status"] in ("ok", "infeasible") and all(k in result for k in keys):
        trial.set_constraint(
            "metric_drop", result.get("metric_drop", 1.0) - max_drop if result["status"] == "ok" else 1.0
        )
        return _told(study, trial, [float(result[k]) for k in keys])
    if result["status"] == "stopped" or (result["status"] in _BAD_CONFIG and result.get("kind") != "deadline"):
        # Told as pruned, not failed: TPE ignores failed trials, so it kept proposing the same
        # failing code path (measured: 250 of 300 proposals of a text search were TorchScript of
        # static int8, every one ruled out), while pruned ones count against their region. An
        # infeasible trial with its measurements was told above, as a constraint violation. A
        # trial stopped early (far below the best) is what Optuna calls pruned.
        return _told(study, trial, state=TrialState.PRUNED)
    return _told(study, trial, state=TrialState.FAIL)


def _told(study: optuna.Study, trial: optuna.Trial, *args: Any, **kwargs: Any) -> FrozenTrial:
    """``study.tell``, where a sampler may stop the study as it would inside ``Study.optimize``
    (a grid sampler with every point visited calls ``study.stop()``, which raises outside
    it); :func:`run_trials` then ends with ``"exhausted"``."""
    local = study._thread_local
    inside = getattr(local, "in_optimize_loop", False)
    local.in_optimize_loop = True
    try:
        return study.tell(trial, *args, **kwargs)
    finally:
        local.in_optimize_loop = inside


def _stopped(study: optuna.Study) -> bool:
    """Whether the sampler stopped the study (:func:`_told`); the flag is cleared for a next run."""
    stopped = bool(getattr(study, "_stop_flag", False))
    study._stop_flag = False
    return stopped


def _tell_unmeasured(
    study: optuna.Study,
    trial: optuna.Trial,
    verdict: str,
    other: FrozenTrial | None,
    attrs: dict[str, Any],
    written: dict[str, Any],
    objectives: list[str],
    max_metric_drop: float,
    n_trials: int,
) -> None:
    """Tell a trial whose claim lost: answered from an earlier trial, or skipped."""
    if verdict == "repeat":
        result = {k: v for k, v in other.user_attrs.items() if k not in attrs and k != "baseline"}
        result.update(attrs, repeat_of=other.number, ran=False, baseline=False)
        _tell(study, trial, TrialResult.from_attrs(result), objectives, max_metric_drop, written)
        return
    reason = (
        f"not run: trial {other.number} is measuring the same configuration"
        if verdict == "duplicate"
        else f"not run: the budget of {n_trials} measured trials is taken by trials measured or running"
    )
    skipped = TrialResult("skipped", verdict, reason, {**attrs, "ran": False})
    _tell(study, trial, skipped, [], 0.0, written)


def _oom_rule(config: dict[str, Any], trials: list[FrozenTrial]) -> str | None:
    from autotune.knobs import declared

    memory = declared("memory")  # the knobs whose values change how much memory a batch needs
    for t in trials:
        if t.user_attrs.get("status") != "oom" or t.user_attrs.get("kind") != "oom":
            continue
        other = t.user_attrs.get("config", {})
        size, ran = values_of(config).batch_size, values_of(other).batch_size
        if all(other.get(k) == config.get(k) for k in memory) and size >= ran:
            same = ", ".join(f"{k}={config[k]}" for k in memory)
            return (
                f"not run: batch_size {size} >= {ran}, which ran out of memory in trial {t.number} with the same {same}"
            )
    return None


def _fault_rule(config: dict[str, Any], trials: list[FrozenTrial]) -> str | None:
    """Why ``config`` is not run for earlier failures, if so. A configuration that failed twice
    with the same values of every knob that decides which code runs (``Knob.code``: TorchScript
    of a statically quantized graph, say) fails again whatever its batch size, loader or threads,
    and the sampler does not learn from failed trials. Three failures on the same path (its
    "path" knobs alone, with any padding or int8 fallback) rule it out too: a text search spent
    30 of 55 trials on TorchScript of static int8, every one failing, across 5 paddings and 3
    fallback values."""
    from autotune.knobs import declared

    failed = [
        t
        for t in trials
        if t.user_attrs.get("status") == "error" and t.user_attrs.get("kind") in ("runtime", "compile")
    ]
    for knobs, times in ((declared("code", "path", "variant"), 2), (declared("code", "path"), 3)):
        same = [t for t in failed if all(t.user_attrs.get("config", {}).get(k) == config.get(k) for k in knobs)]
        if len(same) >= times:
            values = ", ".join(f"{k}={config.get(k)}" for k in knobs)
            numbers = ", ".join(str(t.number) for t in same[:times])
            return (
                f"not run: trials {numbers} failed ({same[0].user_attrs['kind']}) with the same {values}; "
                "it fails whatever the batch size, loader or threads"
            )
    return None
