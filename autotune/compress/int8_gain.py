"""Whether int8 pays: the whole-int8 model timed against the float one, which
``int8_fallback=auto`` asks before it keeps layers float (:func:`autotune.compress.sensitivity._search`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["GAIN_BATCHES", "MIN_INT8_GAIN", "gain_batches", "speed_ratio"]

# ``auto`` keeps layers float only where int8 pays: the whole-int8 model, the fastest build the
# fallback can make, must run at least this much faster than the float one on the calibration
# batches. On a 2-core AMD EPYC with AVX2 only (no VNNI), NNCF's int8 all-MiniLM-L6-v2 ran
# 0.75-0.95x its float IR and missed the guard (0.969 < 0.99); ranking its layers and bisecting
# took 50 s of the trial before the fallback's time budget stopped it with nothing.
MIN_INT8_GAIN = 1.05
# The batches the two builds are timed on: the first few of the calibration draw. On that EPYC the
# float and int8 IRs of all-MiniLM-L6-v2 timed on all 8 batches of 32 took 25-27 s and read
# 0.80-0.82x; on 2 batches 6-7 s, 0.70-0.75x; on 1, 2.5-3 s, 0.70-0.82x: the verdict is the same
# (far under MIN_INT8_GAIN) at a quarter of the cost, which the trial paid in full every time.
GAIN_BATCHES = 2


def gain_batches(batches: Sequence[Any]) -> list[Any]:
    """The batches :func:`speed_ratio` times the two builds on (the first :data:`GAIN_BATCHES`)."""
    return list(batches)[:GAIN_BATCHES]


def speed_ratio(float_pass: Callable[[], Any], int8_pass: Callable[[], Any], reps: int = 3) -> float:
    """How many times faster ``int8_pass`` runs than ``float_pass`` (each a pass over the same
    batches): both run once to warm up, then alternately ``reps`` times; the fastest of each.

    Example:
        >>> speed_ratio(lambda: time.sleep(0.004), lambda: time.sleep(0.001)) > 1.5
        True
    """
    float_pass(), int8_pass()
    best = [math.inf, math.inf]
    for _ in range(reps):
        for i, run in enumerate((float_pass, int8_pass)):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] / max(best[1], 1e-9)
