"""How the search went, told from its trials: the phases with the trials and seconds each took,
when the winner was found, what screening left out, and what shortened timings saved
(multi-fidelity: a screening trial times half the windows; a trial far below the best so far
stops early).

The staged strategy (:mod:`autotune.search.strategy`) marks each configuration it queues with
its phase (``recipe``, ``screen``, ``compose``); the baseline is ``baseline``, and whatever the sampler
proposed is ``refine`` (``tpe`` under plain TPE, whose warm start is TPE's own). Only measured
trials count, as the terminal counts them: a repeat answered from an earlier trial, a skipped
claim or a refusal costs no budget and is not a trial here. The story is told in sentences by
:mod:`autotune.report.story`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.config import values_of
from autotune.search.cost import is_costly

__all__ = ["CONVERGED_AFTER", "PHASES", "converged", "phase_of", "search_story"]

PHASES = ("baseline", "recipe", "screen", "compose", "refine", "tpe")


def phase_of(record: Mapping[str, Any], strategy: str) -> str:
    """The phase a trial's configuration came from."""
    if record.get("baseline"):
        return "baseline"
    if record.get("phase") in ("recipe", "screen", "compose"):
        return record["phase"]
    return "refine" if strategy == "staged" else "tpe"


# Refinement stops once this many trials in a row improved the best by less than the noise.
CONVERGED_AFTER = 5
# An improvement is real when above the measurement's noise: the trials' median window spread,
# this much at least (what screening asks of a lever).
MIN_IMPROVEMENT = 0.03


def converged(
    records: Sequence[Mapping[str, Any]], key: str, maximize: bool = True, k: int = CONVERGED_AFTER
) -> str | None:
    """Why refinement should stop, or ``None``: the last ``k`` measured trials were all
    refinement (proposed by the sampler after the staged phases) and none improved the best
    before it by more than the noise (the measured trials' median coefficient of variation,
    :data:`MIN_IMPROVEMENT` at least). DeepSpeed's autotuner stops after 5 trials without
    improvement; a budget spent on more of them buys nothing.

    Example:
        >>> rows = [{"ran": True, "number": i, "status": "ok", "samples_per_s": v, "cov": 0.01,
        ...          "phase": "screen" if i < 2 else None} for i, v in enumerate([100, 200, 201, 199, 202, 198, 200])]
        >>> converged(rows, "samples_per_s")
        '5 refinement trials in a row improved the best by less than 3% (the measurement noise)'
        >>> converged(rows[:6], "samples_per_s") is None
        True
    """
    measured = [r for r in _measured(records) if r.get("status") in ("ok", "stopped") and r.get(key)]
    if len(measured) <= k or any(phase_of(r, "staged") != "refine" for r in measured[-k:]):
        return None
    covs = sorted(float(r.get("cov") or 0.0) for r in measured)
    noise = max(MIN_IMPROVEMENT, covs[len(covs) // 2])

    def score(r: Mapping[str, Any]) -> float:
        return float(r[key]) if maximize else -float(r[key])

    # Refinement varies the cheap knobs around the fastest cheap configuration (a costly build of
    # the best is applied to a better one after): a cheap trial that beats the cheap ones is progress.
    base = next((r.get("config") or {} for r in measured if r.get("baseline")), {})

    def kind(r: Mapping[str, Any]) -> bool:
        return is_costly(r.get("config") or {}, base)

    best: dict[bool, float] = {}
    for r in measured[:-k]:
        best[kind(r)] = max(best.get(kind(r), score(r)), score(r))
    for r in measured[-k:]:
        before = best.get(kind(r), max(best.values()))  # the first of its kind: against the best
        if score(r) > before + noise * abs(before):
            return None
        best[kind(r)] = max(before, score(r))
    return f"{k} refinement trials in a row improved the best by less than {noise:.0%} (the measurement noise)"


def _measured(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    found = [r for r in records if r.get("ran") and r.get("repeat_of") is None]
    return sorted(found, key=lambda r: r.get("number", 0))


def search_story(
    records: Sequence[Mapping[str, Any]],
    strategy: str,
    winner: int | None = None,
    left_out: Sequence[tuple[Mapping[str, Any], float]] = (),
) -> dict[str, Any]:
    """The phases in order (``phase``, ``n_trials``, ``seconds``), when the winning trial was
    measured (``found``: its phase, how many measured trials and seconds of trials it took to
    get there), and what screening left out (``left_out``: the changes and their measured ratio).

    Example:
        >>> records = [
        ...     {"number": 0, "ran": True, "baseline": True, "wall_s": 2.0},
        ...     {"number": 1, "ran": True, "phase": "screen", "wall_s": 3.0},
        ...     {"number": 2, "ran": False, "status": "skipped"},
        ...     {"number": 3, "ran": True, "phase": "compose", "wall_s": 4.0},
        ... ]
        >>> story = search_story(records, "staged", winner=3)
        >>> [(p["phase"], p["n_trials"], p["seconds"]) for p in story["phases"]]
        [('baseline', 1, 2.0), ('screen', 1, 3.0), ('compose', 1, 4.0)]
        >>> story["found"]
        {'trial': 3, 'phase': 'compose', 'after_trials': 3, 'after_s': 9.0}
    """
    phases: dict[str, dict[str, Any]] = {}
    found, elapsed = None, 0.0
    for i, r in enumerate(_measured(records), start=1):
        phase = phase_of(r, strategy)
        wall = float(r.get("wall_s") or 0.0)
        entry = phases.setdefault(phase, {"phase": phase, "n_trials": 0, "seconds": 0.0})
        entry["n_trials"] += 1
        entry["seconds"] = round(entry["seconds"] + wall, 1)
        elapsed += wall
        if winner is not None and r.get("number") == winner:
            found = {"trial": winner, "phase": phase, "after_trials": i, "after_s": round(elapsed, 1)}
    measured = _measured(records)
    return {
        "strategy": strategy,
        "phases": [phases[p] for p in PHASES if p in phases],
        "found": found,
        "left_out": [{"changes": dict(changes), "ratio": round(ratio, 3)} for changes, ratio in left_out],
        "fidelity": {
            # Timed on fewer windows (screening); a training trial is always timed fully.
            "short": sum(1 for r in measured if r.get("status") != "stopped" and r.get("fidelity_saved_s")),
            "stopped": sum(1 for r in measured if r.get("status") == "stopped"),
            "saved_s": round(sum(float(r.get("fidelity_saved_s") or 0.0) for r in measured), 1),
        },
        "compile": _compile_account(measured),
        "not_started": sum(1 for r in records if r.get("kind") == "deadline" and not r.get("ran")),
    }


def _compile_account(measured: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The seconds the compiled trials spent building and warming up (``compile_s``), and how
    many compiled graphs were read from the study's shared compile cache instead of built."""
    compiled = [r for r in measured if values_of(r.get("config")).compile_mode != "none"]
    return {
        "n_trials": len(compiled),
        "seconds": round(sum(float(r.get("compile_s") or 0.0) for r in compiled), 1),
        "cache_hits": sum(int(r.get("compile_cache_hits") or 0) for r in compiled),
        "cache_misses": sum(int(r.get("compile_cache_misses") or 0) for r in compiled),
    }
