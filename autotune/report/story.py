"""How the search went, in plain sentences for the terminal and the reports: the story
:func:`autotune.search.phases.search_story` tells from the trials, the time the run spent by
phase, and what the shortened timings saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["fidelity_line", "story_lines", "time_line"]


def story_lines(story: Mapping[str, Any] | None) -> list[str]:
    """The story in plain sentences, for the terminal and the report."""
    if not story or not story.get("phases"):
        return []
    parts = [f"{p['phase']} {p['n_trials']} ({p['seconds']:.0f} s)" for p in story["phases"]]
    lines = [f"search ({story['strategy']}): " + ", ".join(parts)]
    found = story.get("found")
    if found:
        lines.append(
            f"the winner (trial {found['trial']}) was measured in the {found['phase']} phase, "
            f"after {found['after_trials']} trials and {found['after_s']:.0f} s of trials"
        )
    for item in story.get("left_out") or []:
        what = ", ".join(f"{k}={v}" for k, v in item["changes"].items())
        lines.append(f"left out after screening: {what} (measured {item['ratio']:.2f}x)")
    if story.get("converged"):
        lines.append(f"the search stopped early: {story['converged']}")
    account = story.get("compile") or {}
    if account.get("n_trials"):
        hits = account.get("cache_hits", 0)
        cache = f"; {hits} of {hits + account.get('cache_misses', 0)} graphs from the compile cache" if hits else ""
        lines.append(f"compiling: {account['seconds']:.0f} s over {account['n_trials']} compiled trials{cache}")
    if story.get("not_started"):
        lines.append(f"{story['not_started']} trials not started: they would not have finished before the deadline")
    line = fidelity_line(story.get("fidelity"))
    lines = [*lines, line] if line else lines
    line = time_line(story.get("time"))
    return [*lines, line] if line else lines


def time_line(seconds: Mapping[str, Any] | None) -> str | None:
    """Where the run's wall time went, the finish by phase.

    Example:
        >>> time_line({"prepare_s": 4.0, "search_s": 180.0, "finish_s": 50.0, "total_s": 234.0,
        ...            "finish": [{"phase": "confirmation", "seconds": 30.0}, {"phase": "export", "seconds": 20.0}]})
        'time: prepare 4 s, search 180 s, finish 50 s (21% of 234 s: confirmation 30 s, export 20 s)'
    """
    if not seconds or not seconds.get("finish"):
        return None
    parts = ", ".join(f"{p['phase']} {p['seconds']:.0f} s" for p in seconds["finish"])
    total, finish = seconds.get("total_s") or 0.0, seconds.get("finish_s") or 0.0
    share = f"{finish / total:.0%} of {total:.0f} s: " if total else ""
    return (
        f"time: prepare {seconds.get('prepare_s', 0.0):.0f} s, search {seconds.get('search_s', 0.0):.0f} s, "
        f"finish {finish:.0f} s ({share}{parts})"
    )


def fidelity_line(fidelity: Mapping[str, Any] | None) -> str | None:
    """What the shortened timings saved, in one sentence (``None`` when nothing was shortened).

    Example:
        >>> fidelity_line({"short": 5, "stopped": 2, "saved_s": 41.3})
        'multi-fidelity: 5 screening trials timed on half the windows, 2 trials stopped early (far below the best so far), about 41 s of timing and guarding saved'
    """
    if not fidelity or not (fidelity.get("short") or fidelity.get("stopped")):
        return None
    parts = []
    if fidelity.get("short"):
        parts.append(f"{fidelity['short']} screening trials timed on half the windows")
    if fidelity.get("stopped"):
        parts.append(f"{fidelity['stopped']} trials stopped early (far below the best so far)")
    return (
        f"multi-fidelity: {', '.join(parts)}, about {fidelity.get('saved_s', 0.0):.0f} s of timing and guarding saved"
    )
