"""Choosing among measured trials: the feasible Pareto front and the winner on it.

Only trials whose status is ``ok`` (measured, guard held) are candidates; each configuration
counts once, with its own measurement (repeats carry a copy of it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autotune.errors import ConfigError

__all__ = ["OBJECTIVES", "candidates", "check_objectives", "pareto_front", "choose", "finalists", "check_select"]

# objective name -> (metric key, direction)
OBJECTIVES: dict[str, tuple[str, str]] = {
    "throughput": ("samples_per_s", "maximize"),
    "latency": ("latency_ms_p95", "minimize"),
    "size": ("size_bytes_compressed", "minimize"),
    "memory": ("peak_mem_mib", "minimize"),
    "metric": ("metric", "maximize"),
}

# A finalist runs at least this share of the fastest trial's samples/s: the selection rounds
# settle ties within the trials' noise (a window CoV of 3-6%), and each finalist costs a build
# and its rounds. Pre-padded real text: a compiled trial 10% behind the fastest eager one was a
# finalist, won the selection by about 4%, and its builds for the selection, the 2 confirmation
# processes and the export made most of a 342-s finish.
FINALIST_SHARE = 0.92
Select = str | Callable[[list[dict[str, Any]]], dict[str, Any]] | None
# Front members within this share of the best on the selecting objective tie: of them the fastest
# wins. (A shrink run picked a candidate 0.80x as fast for 0.6% fewer bytes.)
TIE = 0.02


def check_objectives(objectives: Sequence[str] | str) -> list[str]:
    """The objectives as a list; :class:`ConfigError` for an unknown name, a repeat or none."""
    if isinstance(objectives, str):
        objectives = (objectives,)
    objectives = list(objectives)
    if not objectives:
        raise ConfigError("`objectives` must name at least one of: " + ", ".join(OBJECTIVES) + ".")
    for name in objectives:
        if name not in OBJECTIVES:
            raise ConfigError(f"No objective named {name!r}. Known: {', '.join(OBJECTIVES)}.")
    if len(set(objectives)) != len(objectives):
        raise ConfigError(f"`objectives` names one objective twice: {objectives}.")
    return objectives


def check_select(select: Select) -> None:
    """Raise :class:`ConfigError` unless ``select`` is None, an objective name or a function."""
    if select is None or callable(select) or select in OBJECTIVES:
        return
    raise ConfigError(
        f"`select` must be an objective name ({', '.join(OBJECTIVES)}) or a function of the front's "
        f"records, but got {select!r}."
    )


def _score(record: dict[str, Any], objective: str) -> float:
    """Larger is better, whatever the objective's direction."""
    key, direction = OBJECTIVES[objective]
    return record[key] if direction == "maximize" else -record[key]


def candidates(records: list[dict[str, Any]], objectives: Sequence[str]) -> list[dict[str, Any]]:
    """One record per configuration that passed the guard and has every objective measured."""
    keys = [OBJECTIVES[o][0] for o in objectives]
    by_key: dict[str, dict[str, Any]] = {}
    for rec in records:
        if rec.get("status") == "ok" and all(rec.get(k) is not None for k in keys) and not rec.get("repeat_of"):
            by_key.setdefault(rec["key"], rec)
    return list(by_key.values())


def pareto_front(records: list[dict[str, Any]], objectives: Sequence[str]) -> list[dict[str, Any]]:
    """The candidates no other candidate beats on every objective at once."""
    pool = candidates(records, objectives)

    def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
        sa, sb = [_score(a, o) for o in objectives], [_score(b, o) for o in objectives]
        return all(x >= y for x, y in zip(sa, sb, strict=True)) and sa != sb

    front = [r for r in pool if not any(dominates(o, r) for o in pool)]
    return sorted(front, key=lambda r: -_score(r, objectives[0]))


def choose(records: list[dict[str, Any]], objectives: Sequence[str], select: Select = None) -> dict[str, Any] | None:
    """The winner: the best on the single objective, or with several, the front member that
    ``select`` picks (default: the highest throughput on the front). Members within
    :data:`TIE` of the best on that objective tie, and the fastest of them (by throughput or
    latency, whichever is an objective) wins.

    Example:
        >>> recs = [
        ...     {"key": "a", "status": "ok", "size_bytes_compressed": 1000, "latency_ms_p95": 8.0},
        ...     {"key": "b", "status": "ok", "size_bytes_compressed": 994, "latency_ms_p95": 10.0},
        ...     {"key": "c", "status": "ok", "size_bytes_compressed": 600, "latency_ms_p95": 12.0},
        ... ]
        >>> choose(recs, ["size", "latency"], "size")["key"]
        'c'
        >>> choose(recs[:2], ["size", "latency"], "size")["key"]  # 0.6% fewer bytes is a tie
        'a'
    """
    front = pareto_front(records, objectives)
    if not front:
        return None
    if callable(select):
        return select(front)
    objective = select or ("throughput" if len(objectives) > 1 else objectives[0])
    best = max(front, key=lambda r: _score(r, objective))
    speed = next((o for o in objectives if o in ("throughput", "latency") and o != objective), None)
    if speed is None:
        return best
    margin = TIE * abs(_score(best, objective))
    tied = [r for r in front if _score(best, objective) - _score(r, objective) <= margin]
    return max(tied, key=lambda r: _score(r, speed))


def finalists(
    records: list[dict[str, Any]], objectives: Sequence[str], baseline_key: str, n: int, select: Select = None
) -> list[dict[str, Any]]:
    """Configurations to re-measure against the baseline before the winner is named: the ``n``
    fastest when throughput is the only objective (those within :data:`FINALIST_SHARE` of the
    fastest), else the one ``choose`` picks.

    Example:
        >>> recs = [{"key": k, "status": "ok", "samples_per_s": v} for k, v in (("a", 258.0), ("b", 250.0), ("c", 231.0))]
        >>> [r["key"] for r in finalists(recs, ["throughput"], "base", 3)]
        ['a', 'b']
    """
    if list(objectives) != ["throughput"]:
        pick = choose(records, objectives, select)
        return [pick] if pick is not None and pick["key"] != baseline_key else []
    pool = sorted(
        (r for r in candidates(records, objectives) if r["key"] != baseline_key), key=lambda r: -r["samples_per_s"]
    )
    return [r for r in pool[:n] if r["samples_per_s"] >= FINALIST_SHARE * pool[0]["samples_per_s"]]
