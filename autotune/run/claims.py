"""The speedup a run claims: finalists picked on one set of rounds, the claim made on fresh ones.

Measuring the best few trials once more and reporting the best of them flatters the winner
(the winner's curse: the pick is partly the luckiest measurement). So:

1. *Selection*: the finalists are measured in interleaved rounds whose order alternates
   (A, B, C / C, B, A); the finalist with the best ratio to the first (the fastest trial) is
   picked.
2. *Confirmation*: fresh rounds of the baseline and the pick alone, order alternating, until
   the ratio's 95% confidence interval is within the target (default +-5%) or a cap is hit.

Each round's ratio (pick / baseline in that round) cancels drifts slower than a round. The
claimed speedup is their geometric mean, which is exactly the ratio of the figures shown for
the pick and the baseline (each the geometric mean of its rounds); the interval is a Student-t
interval on the log-ratios. When the interval includes 1.0 there is no measurable speedup and
the baseline is kept; when it lies wholly below 1.0 the pick is measurably slower and the
baseline is kept too; when the rounds ran beside other busy processes, no speedup is claimed,
the baseline is kept too (with throughput the only objective: a pick made under load can be
slower on a quiet machine) and the report says the machine was too busy. On a quiet machine an
interval wider than +-25% that lies wholly above 1.0 is still a measured speedup (every
plausible value beats the baseline: CRAFT over page scans, 4.8-6.1x in three rounds of a few
pages each): it is claimed with ``wide`` set, and its sentence gives the interval's low end as
the least it is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from autotune.trial.intervals import LEVEL, enough_rounds, geomean, half_width, interval

__all__ = [
    "LEVEL",
    "CONFIRM_DRAWS",
    "CONFIRM_PROCESSES",
    "MAX_CLAIM_WIDTH",
    "TARGET_HALF_WIDTH",
    "Claim",
    "enough_rounds",
    "geomean",
    "half_width",
    "interval",
    "judge",
    "shortfall",
]


# A claim whose interval is wider than this (relative, either side) is marked ``wide``.
MAX_CLAIM_WIDTH = 0.25
# Confirmation rounds continue until the interval is within this (relative, either side).
TARGET_HALF_WIDTH = 0.05
# Worker processes the confirmation rounds are split over (where the runner can start a new one):
# a process's speed on a small model can differ from the next one's for its whole life.
CONFIRM_PROCESSES = 2
# Round numbers the confirmation rounds' batch draws start after: the selection rounds' draws
# count from zero, and the claim times batches that picking the finalist did not read.
CONFIRM_DRAWS = 1_000_000

Claim = dict[str, Any]


def judge(
    ratios: Sequence[float],
    others_cpu: float,
    max_others_cpu: float,
    processes: Sequence[float] = (),
    shortfall: str | None = None,
) -> Claim:
    """The verdict on confirmation rounds' ratios (pick / baseline per round).

    Args:
        ratios: One ratio per round.
        others_cpu: Mean share of the machine's CPU other processes used during the rounds.
        max_others_cpu: Above this share the machine counts as busy.
        processes: With rounds in more than one worker process, each process's ratio (the
            geometric mean of its rounds). A process's threads can run a small model at a speed
            that holds for its whole life and differs from the next process's (one or both
            cores used), which rounds within one process cannot show: the interval is widened
            to contain every process's ratio.
        shortfall: What the rounds lacked of what a confirmation sets out to do, and why (fewer
            worker processes or rounds: the time budget), said at the end of the sentence.

    Returns:
        ``{"verdict", "speedup", "low", "high", "median", "min", "max", "n_rounds",
        "others_cpu", "wide", "sentence"}``. ``verdict`` is ``"speedup"`` (the interval lies
        above 1.0 and the machine was quiet; ``wide`` when it is wider than +-25%: the rounds
        disagree, and the sentence says the speedup is at least the interval's low end),
        ``"slower"`` (the whole interval lies below 1.0: the pick is measurably slower, however
        busy the machine or wide the interval), ``"none"`` (the interval includes 1.0: no
        measurable speedup) or ``"noisy"`` (the machine was busy: no claim).

    Example:
        >>> judge([1.5, 1.52, 1.49, 1.51, 1.5], 0.0, 0.1)["verdict"]
        'speedup'
        >>> judge([1.1, 0.9, 1.05, 0.95, 1.0], 0.0, 0.1)["verdict"]
        'none'
        >>> judge([0.95, 0.94, 0.96, 0.95, 0.95], 0.0, 0.1)["verdict"]
        'slower'
        >>> judge([1.5, 1.52, 1.49, 1.51, 0.98, 0.97, 0.99, 0.98], 0.0, 0.1, processes=[1.5, 0.98])["verdict"]
        'none'
        >>> wide = judge([4.84, 5.68, 6.13], 0.0, 0.1)
        >>> wide["verdict"], wide["wide"], wide["sentence"].endswith("at least 4.09x")
        ('speedup', True, True)
    """
    mid, lo, hi = interval(ratios)
    if len(processes) > 1:
        lo, hi = min(lo, *processes), max(hi, *processes)
    busy = others_cpu > max_others_cpu
    wide = not math.isfinite(hi) or max(hi / mid - 1.0, 1.0 - lo / mid) > MAX_CLAIM_WIDTH
    claim: Claim = {
        "speedup": mid,
        "low": lo,
        "high": hi if math.isfinite(hi) else None,
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "n_rounds": len(ratios),
        "others_cpu": others_cpu,
        "busy": busy,
        "processes": [float(p) for p in processes],
        "wide": wide,
        "shortfall": shortfall,
    }
    where = " in 1 process" if shortfall and len(processes) < 2 else ""
    if len(processes) > 1:
        where = f" in {len(processes)} worker processes: " + ", ".join(f"{p:.2f}x" for p in processes)
    span = f"{mid:.2f}x (95% CI {lo:.2f}-{hi:.2f}x over {len(ratios)} rounds{where})"
    if lo <= 1.0 <= hi:
        claim["verdict"] = "none"
        claim["sentence"] = f"no measurable speedup: {span} includes 1.0"
    elif hi < 1.0:
        # Load and spread widen an interval; they do not make a slower pick faster.
        claim["verdict"] = "slower"
        claim["sentence"] = f"the pick is slower than the baseline: {span} lies below 1.0"
    elif busy:
        claim["verdict"] = "noisy"
        claim["sentence"] = (
            f"no speedup claimed: other processes used {others_cpu:.0%} of the CPU during the rounds, so "
            f"{span} is unreliable; measure again on a quiet machine (`autotune doctor` checks the load)"
        )
    else:
        # Spread alone does not undo a speedup whose whole interval beats the baseline (as it does
        # not undo a slowdown below): it is claimed, with the least it is.
        claim["verdict"] = "speedup"
        claim["sentence"] = f"speedup {span}" + (
            f": the rounds disagree, so the speedup is at least {lo:.2f}x" if wide else ""
        )
    if shortfall:
        claim["sentence"] += f"; {shortfall}"
    return claim


def shortfall(
    ratios: Sequence[float], n_processes: int, why: str | None, n_max: int, target: float, max_s: float | None
) -> str | None:
    """What a confirmation lacked of what it sets out to do (rounds in :data:`CONFIRM_PROCESSES`
    fresh worker processes until the interval is within +-``target``, or ``n_max`` rounds), and
    why (``why``: why fewer processes ran); ``None`` when it did all of it. :func:`judge` ends
    the claim's sentence with it.

    Example:
        >>> shortfall([2.0, 2.6], 1, "the time ran out", 15, 0.05, 30.0)[:52]
        'less than planned: 1 process of the 2 planned (the t'
        >>> shortfall([2.0, 2.0, 2.0], 2, None, 15, 0.05, 30.0) is None
        True
    """
    parts = []
    if why is not None and n_processes < CONFIRM_PROCESSES:
        parts.append(f"{n_processes} process of the {CONFIRM_PROCESSES} planned ({why})")
    if len(ratios) < n_max and half_width(ratios) > target and max_s is not None:
        parts.append(
            f"{len(ratios)} rounds, ended by the confirmation's time limit ({max_s:.3g} s) before the interval "
            f"was within +-{target:.0%}"
        )
    return "less than planned: " + "; ".join(parts) if parts else None
