"""What a trial is doing now, for the progress display: building, converting, calibrating,
compiling, timing, checking the metric.

The code of a trial calls :func:`say` as it enters a phase; the process that shows progress sets
the sink with :func:`listen` (a worker process sends each phase to the run over its pipe, an
in-process run calls the display directly). Without a sink, :func:`say` does nothing, and a
sink that fails is ignored: a phase is news, never a reason for a trial to fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["build_phase", "listen", "naming", "say"]

_sink: Callable[[str], None] | None = None


def listen(sink: Callable[[str], None] | None) -> None:
    """Send every phase :func:`say` names to ``sink`` (``None``: to nobody)."""
    global _sink
    _sink = sink


def say(phase: str) -> None:
    """The running trial enters ``phase``."""
    if _sink is not None:
        try:
            _sink(phase)
        except Exception:  # the display's trouble is not the trial's
            pass


@contextlib.contextmanager
def naming(runner: Any, number: int, config: dict[str, Any]) -> Iterator[None]:
    """Trial ``number`` of ``config`` is ``runner.running`` inside the block: the phases its
    worker says are that trial's."""
    runner.running = (number, config)
    try:
        yield
    finally:
        runner.running = None


def build_phase(config: Mapping[str, Any]) -> str:
    """What building ``config`` mostly does, in a word or two.

    Example:
        >>> build_phase(dict(runtime="openvino", ov_precision="int8_static"))
        'converting and calibrating'
        >>> build_phase(dict(prune_ratio=0.3)), build_phase({})
        ('pruning', 'building')
    """
    from autotune.config import values_of
    from autotune.knobs.compress import is_int8

    knobs, int8 = values_of(config), is_int8(config)
    if knobs.runtime != "torch":
        return "converting and calibrating" if int8 else "converting"
    if knobs.prune_ratio:
        return "pruning"
    return "calibrating" if int8 else "building"
