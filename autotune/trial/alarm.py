"""A time limit on in-process work: :func:`alarm` raises :class:`Overrun` into it (SIGALRM)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Overrun", "alarm"]


class Overrun(BaseException):
    """Raised into in-process work by its alarm; a BaseException, so no ``except Exception`` in
    the trial's code takes it for the trial's own fault."""


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise :class:`Overrun` in the block after ``seconds`` (a SIGALRM timer). Only the main
    thread of a POSIX process receives it; elsewhere the block runs unbounded."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise Overrun

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
