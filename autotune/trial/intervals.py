"""Intervals on paired ratios: the geometric mean of interleaved rounds' ratios, its Student-t
interval on their logs, and when rounds may stop. The rounds run inside the worker
(:meth:`autotune.trial.context.Context.rounds`); :mod:`autotune.run.claims` judges them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["LEVEL", "enough_rounds", "geomean", "half_width", "interval"]

# The intervals' confidence level (the t quantiles below are its two-sided ones).
LEVEL = 0.95
# Two-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom (then the normal's).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def geomean(values: Sequence[float]) -> float:
    """The geometric mean of positive numbers.

    Example:
        >>> round(geomean([1.0, 4.0]), 6)
        2.0
    """
    return math.exp(statistics.fmean(math.log(v) for v in values))


def interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high) of paired ratios: a 95% Student-t interval on their logs.

    With one ratio the interval is unbounded (0, inf): one round proves nothing.

    Example:
        >>> mid, lo, hi = interval([2.0, 2.1, 1.9, 2.0, 2.05])
        >>> round(mid, 2), lo < mid < hi, hi / lo < 1.1
        (2.01, True, True)
    """
    logs = [math.log(r) for r in ratios]
    mid = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mid), 0.0, math.inf
    t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mid), math.exp(mid - half), math.exp(mid + half)


def half_width(ratios: Sequence[float]) -> float:
    """The interval's larger relative distance from its centre (0.05 means within +-5%)."""
    mid, lo, hi = interval(ratios)
    return max(hi / mid - 1.0, 1.0 - lo / mid) if math.isfinite(hi) else math.inf


def enough_rounds(
    rounds: Sequence[Sequence[dict[str, Any]]], n_min: int, target: float | None, max_s: float | None, elapsed: float
) -> bool:
    """Whether interleaved rounds may stop: at least ``n_min`` done, and either ``max_s`` seconds
    spent or (two configurations, a ``target``) the ratio's interval within +-``target``.

    Example:
        >>> row = [{"samples_per_s": 100.0}, {"samples_per_s": 150.0}]
        >>> enough_rounds([row] * 3, 3, 0.05, None, 1.0), enough_rounds([row] * 2, 3, 0.05, None, 1.0)
        (True, False)
    """
    if len(rounds) < n_min:
        return False
    if max_s is not None and elapsed > max_s:
        return True
    if target is None or len(rounds[0]) != 2:
        return False
    return half_width([r[1]["samples_per_s"] / r[0]["samples_per_s"] for r in rounds]) <= target
