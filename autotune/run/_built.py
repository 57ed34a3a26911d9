"""Tuned models built once per process, for :func:`~autotune.predict`, :func:`~autotune.predictor`
and :func:`~autotune.load` with ``model=``.

A compiled winner costs seconds per batch shape to build (MiniLM with trimmed padding: 36 s the
first time, 23 s for each later ``predict`` that built it again), and ``predict`` is the path a
user calls per request. So a build is kept, keyed on the user's model object (held weakly: the
entry goes with it), the config and the device, and a later call with the same ones reuses it.
What the model held when it was tuned is kept beside it (each weight's storage and version
counter, which in-place updates through torch bump: an optimizer step, ``load_state_dict``); a
model changed since is tuned again, and the call says so in one warning line.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Built", "build_once", "clear"]

# Builds kept at once: a process rarely serves more models than this, and each holds its weights.
MAX_BUILT = 4


@dataclasses.dataclass
class Built:
    """One tuned model kept for reuse.

    Attributes:
        model: The tuned model (what :func:`~autotune.apply` returned).
        build_s: Seconds its build took.
        reused: Whether this call found it built already.
    """

    model: Any
    build_s: float
    reused: bool = False
    source: Any = None  # a weak reference to the user's model or factory
    fingerprint: tuple[Any, ...] | None = None


_BUILT: collections.OrderedDict[tuple[Any, ...], Built] = collections.OrderedDict()


def fingerprint(model: Any) -> tuple[Any, ...] | None:
    """What ``model``'s weights are now: each parameter's and buffer's name, storage, shape and
    version counter (``None`` for a factory, which builds a fresh model each time)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return None
    found = []
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        try:
            version = t._version
        except RuntimeError:  # an inference tensor keeps no version counter
            version = -1
        found.append((name, t.data_ptr(), tuple(t.shape), version))
    return tuple(found)


def build_once(model: Any, key: tuple[Any, ...], build: Callable[[], Any], what: str, warn: bool = True) -> Built:
    """The tuned model of ``model`` for ``key`` (config, device, ...), built by ``build`` on the
    first call in this process and reused after, while ``model`` holds the weights it was tuned
    with. A model changed since is built again, with a warning that says so; one that cannot be
    held weakly is built on every call, with a warning too.

    Args:
        model: The user's model or factory.
        key: What else the build depends on (hashable).
        build: Builds the tuned model.
        what: The caller's name (``"predict"``), for the warning.
        warn: Whether a model that cannot be held weakly is said to be built on every call (a
            cheap build, a copy of the model, needs no word).
    """
    full = (id(model), *key)
    try:
        # The callback holds the key, not the model: the entry goes when the model does.
        source = weakref.ref(model, lambda _, full=full: _BUILT.pop(full, None))
    except TypeError:
        if warn:
            warnings.warn(f"{what}: this `model` cannot be kept between calls, so each call tunes it again (a compiled "
                          "config compiles again): build an autotune.predictor once and call it instead.", stacklevel=3)  # fmt: skip
        return _timed(build)
    now = fingerprint(model)
    entry = _BUILT.get(full)
    if entry is not None and entry.source() is model:
        if entry.fingerprint == now:
            _BUILT.move_to_end(full)
            entry.reused = True
            return entry
        warnings.warn(f"{what}: `model` changed since this process tuned it (its weights or modules differ), so it is "
                      "tuned again (a compiled config compiles again); calls with it unchanged reuse this build.",
                      stacklevel=3)  # fmt: skip
    entry = _timed(build)
    entry.source, entry.fingerprint = source, now
    _BUILT[full] = entry
    while len(_BUILT) > MAX_BUILT:
        _BUILT.popitem(last=False)
    return entry


def _timed(build: Callable[[], Any]) -> Built:
    started = time.perf_counter()
    model = build()
    return Built(model, time.perf_counter() - started)


def clear() -> None:
    """Forget every kept build (their models are freed once nothing else holds them)."""
    _BUILT.clear()
