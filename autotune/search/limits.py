"""How long and how fully a trial is timed: the per-trial time limit (adaptive, or the user's),
never past the search's deadline less the run's finish, and the multi-fidelity share of the
windows a screening trial gets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from autotune.record import trial_record
from autotune.search.cost import HEAVY_KNOBS, is_costly, trial_cost_s
from autotune.search.history import PAST_ATTR
from autotune.search.record import _finished, _has_result
from autotune.search.space import SearchSpace
from autotune.trial.runner import Runner

# The adaptive per-trial timeout: a multiple of the baseline trial's wall time, with a floor,
# plus an allowance for configurations that compile, quantize, prune or convert the model.
TIMEOUT_FLOOR_S = 30.0
TIMEOUT_FACTOR = 10.0
COMPILE_ALLOWANCE_S = 120.0
# Before the baseline has run nothing is known: its own limit.
FIRST_TRIAL_TIMEOUT_S = 600.0
_HEAVY_KNOBS = HEAVY_KNOBS


def trial_limit(config: Mapping[str, Any], baseline: Mapping[str, Any] | None, fixed: float | None) -> float:
    """Seconds one trial of ``config`` may take: ``fixed`` when the user set ``trial_timeout``,
    else adaptive: ``max(30 s, 10 x the baseline trial's wall time)``, plus 120 s when
    ``config`` compiles, quantizes, prunes or changes the runtime; 600 s for the baseline itself.

    Example:
        >>> baseline = {"config": dict(compile_mode="none"), "wall_s": 4.0}
        >>> trial_limit(dict(compile_mode="none"), baseline, None)
        40.0
        >>> trial_limit(dict(compile_mode="default"), {**baseline, "wall_s": 1.0}, None)
        150.0
    """
    if fixed is not None:
        return float(fixed)
    if baseline is None:
        return FIRST_TRIAL_TIMEOUT_S
    wall = baseline.get("wall_s") or baseline.get("trial_s") or FIRST_TRIAL_TIMEOUT_S / TIMEOUT_FACTOR
    limit = max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * wall)
    base = baseline.get("config") or {}
    if any(config.get(k) != base.get(k) for k in _HEAVY_KNOBS if k in config):
        limit += COMPILE_ALLOWANCE_S
    return limit


# A screening trial times this share of the windows: it only has to tell a lever that pays
# from one that does not; the finalists are timed again in selection rounds anyway.
SCREEN_SHARE = 0.5


def trial_fidelity(
    phase: str | None,
    baseline: bool,
    objectives: Sequence[str],
    finished: Sequence[FrozenTrial],
    space: SearchSpace | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """How fully a trial is timed (multi-fidelity): a screening trial gets :data:`SCREEN_SHARE`
    of the windows; with throughput first, any trial but the baseline gets the ``best``
    samples/s measured so far, and stops early (once a few batches are timed) if it runs under the timing
    settings' ``stop_share`` of it. Only trials that can win set the best: with ``space``, those
    it contains (not the model as given where ``fix`` pins a knob elsewhere, or the one
    candidate holding the fixed value would be stopped and none would be left). With ``config``
    and ``space``, the best is that of trials of its kind: costly builds (a compile, another
    runtime, int8) or not. A cheap trial far below a compiled best can still move the cheap
    configuration the compile is applied to (see :class:`autotune.search.strategy.Staged`).
    The baseline is ``paired``: timed in full, and not again for windows that disagree on a
    quiet machine.

    Example:
        >>> trial_fidelity("screen", False, ["latency"], [])
        {'share': 0.5}
        >>> trial_fidelity(None, True, ["throughput"], [])
        {'paired': True}
    """
    fidelity: dict[str, Any] = {"share": SCREEN_SHARE} if phase == "screen" else {}
    if baseline:
        # The finish times it again in rounds beside the pick, which the claim is made from: its
        # windows disagreeing on a quiet machine is no reason to take it again here (the Hugging
        # Face pipeline's baseline, batches of every length, took 26 s to measure 3 times).
        fidelity["paired"] = True
    if baseline or not objectives or objectives[0] != "throughput":
        return fidelity

    def kind(c: Mapping[str, Any]) -> bool:
        return space is not None and is_costly(c, space.baseline)

    speeds = [
        t.user_attrs.get("samples_per_s")
        for t in finished
        if t.user_attrs.get("status") == "ok"
        and (space is None or space.contains(t.user_attrs.get("config") or {}))
        and (config is None or kind(t.user_attrs.get("config") or {}) == kind(config))
    ]
    best = max((float(v) for v in speeds if v), default=None)
    if best:
        fidelity["best"] = best
    return fidelity


class Afford:
    """Under a deadline: whether trials of some configurations, one after another, fit in the
    ``left`` seconds (called with them), each one's predicted ``cost``, and what the runs before
    measured (``past``, by kind of build: :mod:`autotune.search.history`)."""

    def __init__(self, left: float, cost: Callable[[Mapping[str, Any]], float], past: Mapping[str, Any]) -> None:
        self.left, self.cost, self.past = left, cost, past

    def __call__(self, configs: Sequence[Mapping[str, Any]]) -> bool:
        return sum(self.cost(c) for c in configs) <= self.left


class _Limits:
    """Each trial's time limit: adaptive (or the user's), and never past the search's deadline:
    the study's, less the ``reserve`` the run keeps for its finish."""

    def __init__(
        self,
        runner: Runner,
        fixed: float | None,
        deadline: float | None,
        timeout: float | None,
        reserve: Callable[[list[dict[str, Any]]], float] | None = None,
        study: optuna.Study | None = None,
    ) -> None:
        self.runner, self.fixed, self.deadline, self.timeout = runner, fixed, deadline, timeout
        self.reserve = reserve
        # What the runs before measured of this model's builds (autotune.search.history): prices
        # under a deadline, read once.
        known = study is not None and deadline is not None
        self.past = dict((study.user_attrs.get(PAST_ATTR) if known else None) or {})
        self.baseline: dict[str, Any] | None = None

    def learn(self, baseline: FrozenTrial | None) -> None:
        """Take the baseline's wall time once it is measured; the runner's calls (the rounds,
        the export) then get the limit of a compiling configuration per unit of work."""
        if self.baseline is not None or baseline is None or baseline.user_attrs.get("status") != "ok":
            return
        self.baseline = dict(baseline.user_attrs)
        heavy = {k: f"{self.baseline['config'].get(k)}-other" for k in _HEAVY_KNOBS}
        self.runner.timeout = trial_limit(heavy, self.baseline, self.fixed)

    def _left(self, records: list[dict[str, Any]]) -> float | None:
        """Seconds the search has left (the finish's reserve taken off), ``None`` without a deadline."""
        if self.deadline is None:
            return None
        kept = self.reserve(records) if self.reserve is not None and self.baseline is not None else 0.0
        return self.deadline - kept - time.monotonic()

    def afford(self, records: list[dict[str, Any]]) -> Afford | None:
        """Whether trials of some configurations, one after another, fit in what the search has
        left (their predicted costs, :func:`trial_cost_s`); ``None`` without a deadline."""
        left = self._left(records)
        if left is None or self.baseline is None:
            return None
        return Afford(left, lambda c: trial_cost_s(c, records, self.baseline, self.past), self.past)

    def out_of_time(self, study: optuna.Study) -> bool:
        """Whether the search must stop: its deadline passed, or not even a trial as cheap as
        the baseline would finish before it."""
        records = [trial_record(t) for t in _finished(study)] if self.deadline is not None else []
        left = self._left(records)
        if left is None:
            return False
        cheapest = trial_cost_s(self.baseline["config"], records, self.baseline, self.past) if self.baseline else 0.0
        return left <= 0 or left < cheapest

    def too_late(self, config: Mapping[str, Any], finished: list[FrozenTrial]) -> str | None:
        """Why a trial of ``config`` is not started (its predicted cost exceeds what the search
        has left), or ``None``."""
        if self.deadline is None or self.baseline is None:
            return None
        records = [trial_record(t) for t in finished]
        left = self._left(records)
        cost = trial_cost_s(config, records, self.baseline, self.past)
        if left is None or cost <= left:
            return None
        measured = "the trials measured, here and in the runs before" if self.past else "the trials measured"
        return (
            f"not started: it would take about {cost:.0f} s (predicted from {measured}) and the search "
            f"had {max(left, 0.0):.0f} s left before the run's deadline"
        )

    def for_config(self, config: Mapping[str, Any], finished: list[FrozenTrial]) -> tuple[float, bool]:
        """(seconds, whether the search's deadline is what limits them): a trial that runs past
        its predicted cost is stopped where the finish's reserve begins, not after eating it."""
        limit = trial_limit(config, self.baseline, self.fixed)
        left = self._left([trial_record(t) for t in finished]) if self.deadline is not None else None
        if left is not None and left < limit:
            return max(left, 0.0), True
        return limit, False

    def timeout_reason(self, limit: float, at_deadline: bool) -> dict[str, Any]:
        if at_deadline:
            return {
                "kind": "deadline",
                "reason": f"stopped at the study's deadline (timeout={self.timeout:g} s) after {limit:.0f} s; "
                "its worker was killed",
            }
        how = "trial_timeout" if self.fixed is not None else "the adaptive limit (see trial_timeout)"
        return {"reason": f"no result within {limit:.0f} s, {how}; the worker was killed"}


def requeue_refused(study: optuna.Study, limits: _Limits) -> bool:
    """Queue again the first trial not started for the deadline whose configuration now fits in
    what the search has left: its price fell (a trial of its runtime measured what its build
    costs) or the finish's reserve did (a cheaper pick). Each refused trial is queued again once;
    return whether one was.

    A budget's first OpenVINO trial of real MiniLM was refused at 54 s (priced 56 s), and the
    next 54 s went to nine cheap trials at 0.4-0.7x of the best: the lever that won the same
    pipeline's 16-trial run never came back.
    """
    trials = study.get_trials(deepcopy=False)
    finished = _finished(study)
    measured = {t.user_attrs.get("key") for t in finished if _has_result(t.user_attrs)}
    waiting = {t.user_attrs.get("queued_key") for t in trials if not t.state.is_finished()}
    requeued = {t.user_attrs.get("requeue_of") for t in trials}
    for t in finished:
        attrs = t.user_attrs
        if attrs.get("kind") != "deadline" or attrs.get("ran") or t.number in requeued or "config" not in attrs:
            continue
        if attrs.get("key") in measured or attrs.get("key") in waiting:
            continue
        if limits.too_late(attrs["config"], finished) is not None:
            continue
        study.enqueue_trial(dict(t.params), user_attrs={"phase": attrs.get("phase"), "queued_key": attrs.get("key"),
                                                        "requeue_of": t.number})  # fmt: skip
        return True
    return False
