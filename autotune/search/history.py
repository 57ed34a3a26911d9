"""What the runs before this one measured the same model's costly builds at, on this machine:
what each kind of build (a compile, OpenVINO, its int8) cost beyond a plain trial, and how fast
it ran against the fastest plain configuration.

A run prices each trial before it starts (:mod:`autotune.search.cost`), and a first build of a
kind is priced from priors: for real MiniLM on 2 cores, OpenVINO's int8 at 31 s (NNCF's
calibration) and a compile at 59 s. A second run reads both from the machine's cache (the int8
model NNCF made, inductor's graphs), and the same builds took 6-11 s and 16-25 s; priced from the
priors, a 90-s budget after such a run refused all three with 8 s left, and ended on a plain
configuration at 0.58 of the int8 winner. So each run leaves beside the machine's cache, keyed
as its entries are (the model's code, structure and weights) with the number of samples and the
hardware, the
kinds of build it measured: their cost beyond its plain trials with what the caches now keep
taken off (:func:`past_builds`), and their speed against its fastest plain
configuration. The next run of the same model prices a first build of a kind it has no trial of
from there, and, under a deadline, builds first what promises most per second
(:func:`by_gain`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.search.cost import cached_s, kind_label, measured_trials, once_s

__all__ = ["PAST_ATTR", "PRIOR_GAIN", "by_gain", "history_key", "past_builds", "read_history", "write_history"]

# The study attribute that holds what the runs before measured (read by the search's pricing).
PAST_ATTR = "past_builds"
# The folder, inside the machine's cache, of one file per model and dataset size.
_FOLDER = "history"
_FORMAT = 1
# A build no run measured is expected to run this much faster than the best plain configuration:
# one figure for all, so among builds no run has measured the cheapest goes first.
PRIOR_GAIN = 1.3


def history_key(digest: str | None, n_samples: int | None, hardware: str = "") -> str | None:
    """The history's key of a model whose :func:`~autotune.export.run_cache.model_digest` is
    ``digest`` (its code, structure, parameters and buffers, as the cache's entries are keyed),
    with the number of samples a trial runs and the ``hardware`` it runs on (a cache folder in a
    home shared by several machines); ``None`` without a digest."""
    import hashlib

    if not digest:
        return None
    return hashlib.sha256(f"{_FORMAT}:{digest}:{n_samples}:{hardware}".encode()).hexdigest()[:24]


def _path(folder: Path, key: str) -> Path:
    return Path(folder) / _FOLDER / f"{key}.json"


def read_history(folder: Path | None, key: str | None) -> dict[str, dict[str, Any]]:
    """What the runs before measured, by kind of build (:func:`autotune.search.cost.kind_label`):
    ``{"extra_s", "ratio"}``; empty where nothing is kept or it cannot be read."""
    if folder is None or key is None:
        return {}
    try:
        saved = json.loads(_path(folder, key).read_text())
    except (OSError, ValueError):
        return {}
    kinds = saved.get("kinds") if isinstance(saved, dict) and saved.get("format") == _FORMAT else None
    return {k: v for k, v in (kinds or {}).items() if isinstance(v, dict) and "extra_s" in v}


def write_history(folder: Path | None, key: str | None, measured: Mapping[str, Mapping[str, Any]]) -> None:
    """Keep ``measured`` (by kind, as :func:`read_history` gives it) over what was kept for the
    same kinds; the others stay. Written whole (a reader never sees half of it); a failure to
    write only loses the hint."""
    if folder is None or key is None or not measured:
        return
    path = _path(folder, key)
    kinds = {**read_history(folder, key), **measured}
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(json.dumps({"format": _FORMAT, "kinds": kinds}, default=str))
        part.replace(path)
    except OSError:
        part.unlink(missing_ok=True)


def by_gain(
    steps: Sequence[Sequence[Mapping[str, Any]]],
    candidates: Callable[[Sequence[Mapping[str, Any]]], list[dict[str, Any] | None]],
    cost: Callable[[Mapping[str, Any]], float],
    gain: Callable[[Mapping[str, Any]], float | None],
) -> list[Sequence[Mapping[str, Any]]]:
    """``steps`` (each a costly lever's variants) with those measured through first, as they
    came, then the rest by the most expected gain per second of their variants not measured:
    ``candidates(variants)`` gives each variant's configuration (``None`` where measured or it
    cannot run), ``cost`` its predicted seconds and ``gain`` its expected speed against the best
    plain configuration (``None``: :data:`PRIOR_GAIN`). A build expected no faster waits last.

    Example:
        >>> steps = [[{"c": 1}], [{"o": 1}], [{"i": 1}]]
        >>> seconds = {"c": 25.0, "o": 4.0, "i": 9.0}
        >>> ratio = {"c": 0.98, "o": 1.1, "i": 1.6}
        >>> name = lambda config: next(iter(config))
        >>> by_gain(steps, lambda vs: [dict(v) for v in vs], lambda c: seconds[name(c)], lambda c: ratio[name(c)])
        [[{'i': 1}], [{'o': 1}], [{'c': 1}]]
    """

    def rate(variants: Sequence[Mapping[str, Any]]) -> float:
        found = [c for c in candidates(variants) if c is not None]
        if not found:
            return float("inf")  # measured through: first, as it came
        return max((((gain(c) or PRIOR_GAIN) - 1.0) / max(cost(c), 1.0) for c in found), default=0.0)

    rates = [rate(v) for v in steps]
    order = sorted(range(len(steps)), key=lambda i: (-rates[i] if rates[i] != float("inf") else float("-inf"), i))
    return [steps[i] for i in order]


def past_builds(
    records: Sequence[Mapping[str, Any]],
    baseline: Mapping[str, Any] | None,
    score: Callable[[Mapping[str, Any]], float | None] | None = None,
) -> dict[str, dict[str, Any]]:
    """What this run measured of each kind of build, for the next run of the same model
    (:func:`write_history`): ``extra_s``, the most a trial of it took
    (measured once) beyond the run's plain trials, less what the caches keep of it now (the
    conversion, the int8 model it made), and ``ratio``, its best ``score`` over the best plain
    configuration's (``None`` without ``score``).

    Example:
        >>> base = {"config": dict(runtime="torch"), "wall_s": 12.0, "baseline": True, "sps": 100.0}
        >>> plain = {"config": dict(runtime="torch", batch_size=64), "wall_s": 5.0, "sps": 400.0}
        >>> int8 = {"config": dict(runtime="openvino", ov_precision="int8_static"), "wall_s": 30.0,
        ...         "int8_made_s": 20.0, "sps": 640.0}
        >>> past_builds([base, plain, int8], base, lambda r: r["sps"])
        {'runtime=openvino,ov_precision=int8_static': {'extra_s': 5.0, 'ratio': 1.6}}
    """
    if baseline is None or not baseline.get("wall_s"):
        return {}
    base_config, measured = baseline.get("config") or {}, measured_trials(records)
    plain = [r for r in measured if not kind_label(r["config"], base_config)]
    full = [r for r in plain if not r.get("baseline") and r.get("status", "ok") == "ok"]
    cheap_s = max((once_s(r) for r in full), default=once_s(baseline))
    scored = [(score(r) if score else None) for r in plain]
    best_plain = max((s for s in scored if s), default=None)
    found: dict[str, dict[str, Any]] = {}
    for r in measured:
        label = kind_label(r["config"], base_config)
        if not label:
            continue
        extra = max(0.0, once_s(r) - cached_s(r) - cheap_s)
        value = score(r) if score else None
        ratio = round(value / best_plain, 4) if value and best_plain else None
        was = found.get(label, {"extra_s": 0.0, "ratio": None})
        found[label] = {"extra_s": round(max(was["extra_s"], extra), 3),
                        "ratio": max((x for x in (was["ratio"], ratio) if x is not None), default=None)}  # fmt: skip
    return found
