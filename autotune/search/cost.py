"""What a trial and a run's finish cost in seconds, predicted from what the study measured.

A run with a deadline must not start work it cannot finish: a compile trial started with 8 s
left is killed and measures nothing, and a search that runs to the deadline leaves the
confirmation one second. So each trial's cost is predicted before it starts, from the trials
already measured (the baseline's wall time; for a configuration that compiles, quantizes or
changes the runtime, what such a build cost so far, or a prior until one was measured), and the
finish (worker starts, the builds and rounds of the confirmation, the export) is priced from the
same figures and kept free of the search.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.knobs import declared

__all__ = [
    "HEAVY_KNOBS",
    "build_s",
    "cached_s",
    "export_s",
    "finish_s",
    "is_costly",
    "kind_label",
    "measure_s",
    "measured_trials",
    "once_s",
    "rebuild_s",
    "selection_s",
    "trial_cost_s",
]

# Knobs whose change costs a build of its own (a compile, an export, a calibration) beyond the
# baseline's, as each knob declares (``heavy``): a configuration that changes one is priced by the
# builds of its kind measured so far.
HEAVY_KNOBS = declared("heavy")
# A pruning's prior (a structural pruning and its fine-tuning), before one was measured.
HEAVY_PRIOR_S = 15.0
# Knobs that make a build of another price under the same heavy knobs: OpenVINO's int8 (NNCF's
# calibration, the fallback's ranking: 13-20 s of real MiniLM) against its float builds (2 s).
# Priced as OpenVINO's float trials (8 s), a 3-minute budget started one with 18 s left, and it
# was killed at the deadline; a first one is priced with a calibration (FIRST_BUILD_S).
PRICE_KNOBS = (*HEAVY_KNOBS, *declared("prices"))
# Confirmation rounds the finish must have time for (the least a claim is made from), and the
# worker processes they are split over.
FINISH_ROUNDS = 3
FINISH_PROCESSES = 2
# A confirmation round times one window of each configuration
# (:data:`autotune.trial.inference.ROUND_WINDOWS`), which runs past its seconds to an epoch's end
# where batches differ in cost; it is priced at two of a trial's windows. The price also decides
# whether a short budget starts fresh workers for its rounds, two at once: priced at one window,
# a 45-s quickstart run started them (each trains its MLP in the cfg's model(), 7-9 s together
# on 2 cores) and its deadline cut them off, with nothing confirmed, in three runs of four.
ROUND_PRICE_WINDOWS = 2
# A spare worker's start beside another's, against a start alone: a Hugging Face pick's two
# starts took 4.2 s together (the first's 4.1 s alone).
SPARE_START = 0.3


def _heavy(config: Mapping[str, Any], base: Mapping[str, Any]) -> tuple[Any, ...]:
    """The heavy knobs ``config`` sets away from ``base``: two configurations with the same
    build the same kind of thing."""
    return tuple((k, config.get(k)) for k in HEAVY_KNOBS if k in config and config.get(k) != base.get(k))


def _kind(config: Mapping[str, Any], base: Mapping[str, Any]) -> tuple[Any, ...]:
    """What prices ``config``'s build: its heavy knobs and :data:`PRICE_KNOBS` away from ``base``."""
    return tuple((k, config.get(k)) for k in PRICE_KNOBS if k in config and config.get(k) != base.get(k))


def kind_label(config: Mapping[str, Any], base: Mapping[str, Any]) -> str:
    """The kind of build ``config`` makes, as text (what the runs' history is kept by): its
    heavy and pricing knobs away from ``base``; ``""`` for a plain configuration.

    Example: ``runtime=openvino,ov_precision=int8_static``."""
    return ",".join(f"{k}={v}" for k, v in _kind(config, base))


def _calibrates(kind: tuple[Any, ...]) -> bool:
    """Whether a build of ``kind`` quantizes (int8 under a runtime, PyTorch's quantization)."""
    return any(k == "quantization" or str(v).startswith("int8") for k, v in kind)


def is_costly(config: Mapping[str, Any], base: Mapping[str, Any]) -> bool:
    """Whether ``config`` costs a build of its own beyond ``base``'s (a heavy knob differs).

    Example:
        >>> is_costly({"compile_mode": "default"}, {"compile_mode": "none"}), is_costly({"batch_size": 64}, {})
        (True, False)
    """
    return bool(_heavy(config, base))


def measured_trials(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Trials that ran, with their wall time: a trial killed at its limit has only ``trial_s``,
    and a compile that ran out of time must raise the price of the next, not be forgotten."""
    found = []
    for r in records:
        wall = r.get("wall_s") or r.get("trial_s")
        if r.get("ran", True) and wall and isinstance(r.get("config"), Mapping) and r.get("kind") != "deadline":
            found.append({**r, "wall_s": wall})
    return found


def once_s(record: Mapping[str, Any]) -> float:
    """Wall seconds of ``record``'s trial as if measured once: a trial whose windows disagreed is
    measured again (up to three times), which a trial of the next configuration need not be.

    Example:
        >>> once_s({"wall_s": 34.0, "timed_s": 11.3, "compile_s": 1.4, "guard_s": 3.9, "n_measurements": 2})
        20.3
        >>> once_s({"trial_s": 9.0})
        9.0
    """
    wall = float(record.get("wall_s") or record.get("trial_s") or 0.0)
    again = max(0, int(record.get("n_measurements") or 1) - 1)
    return round(wall - again * measure_s({**record, "wall_s": wall}), 6) if again else wall


def trial_cost_s(
    config: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    baseline: Mapping[str, Any] | None,
    past: Any = None,
) -> float:
    """Predicted wall seconds of a trial of ``config``, each trial counted as measured once
    (:func:`once_s`): the longest measured trial that built the same heavy knobs (compile mode,
    runtime, ...; for the cheap kind, a trial other than the baseline's where one ran its
    windows: the baseline's also computes the reference outputs), else a cheap trial of it plus
    what its build is made of (a compile, a runtime's conversion, a calibration, a pruning), each
    part priced by the most a trial that made it took, or by its measured prior
    (:data:`FIRST_BUILD_S`, by the model's parameters). Builds of another precision under the
    same runtime are of another kind (:data:`PRICE_KNOBS`): a first int8 build under a runtime
    whose float builds were measured costs the slowest of them and a calibration. A first build
    of a kind the runs before measured on this machine (``past``, :mod:`autotune.search.history`)
    costs a cheap trial and what it cost them beyond theirs, less what the caches keep. 0 before
    the baseline was measured.

    Priced from the baseline's wall time, a cheap trial of real MiniLM cost 34 s (its windows
    measured twice, and the reference outputs) where it took 13: a 3-minute budget's search
    ended after the baseline.

    Example:
        >>> base = {"config": {"compile_mode": "none", "batch_size": 8}, "ran": True, "wall_s": 2.0}
        >>> trial_cost_s({"compile_mode": "none", "batch_size": 32}, [base], base)
        2.0
        >>> trial_cost_s({"compile_mode": "default", "batch_size": 8}, [base], base)  # a compile's prior
        22.0
        >>> done = {"config": {"compile_mode": "default", "batch_size": 8}, "ran": True, "wall_s": 40.0,
        ...         "compile_s": 30.0}
        >>> trial_cost_s({"compile_mode": "default", "batch_size": 32}, [base, done], base)
        40.0
        >>> trial_cost_s({"compile_mode": "max-autotune", "batch_size": 8}, [base, done], base)
        32.0
    """
    if baseline is None or not baseline.get("wall_s"):
        return 0.0
    base_config, base_s = baseline.get("config") or {}, once_s(baseline)
    kind = _kind(config, base_config)
    measured = measured_trials(records)
    same = [r for r in measured if _kind(r["config"], base_config) == kind]
    # A cheap trial: priced by those that ran their windows, the baseline's only before any did.
    full = [r for r in same if not kind and not r.get("baseline") and r.get("status", "ok") == "ok"]
    if same:
        return max(once_s(r) for r in full or same)
    if not kind:
        return base_s
    # The same configuration built as the baseline's: what its batches and loader cost.
    cheap = trial_cost_s({k: v for k, v in config.items() if k not in PRICE_KNOBS} | _cheap_part(base_config),
                         records, baseline)  # fmt: skip
    before = (past or {}).get(kind_label(config, base_config))
    if before is not None:
        return cheap + float(before["extra_s"])
    # The same runtime's float builds (not another int8 of it, which calibrated too), and a calibration.
    floats = [
        r
        for r in measured
        if _heavy(r["config"], base_config) == _heavy(config, base_config)
        and not _calibrates(_kind(r["config"], base_config))
    ]
    if floats and _calibrates(kind):
        return max(once_s(r) for r in floats) + _part_s("calibrate", measured, baseline)
    # A first build of its kind: a cheap trial and what its build is made of, each part priced
    # by what it cost in the trials that made one, else by its prior (FIRST_BUILD_S).
    return cheap + sum(_part_s(part, measured, baseline) for part in _parts(kind))


# What a first build of a kind adds to a cheap trial, part by part, before a trial made that part:
# seconds, plus seconds per million parameters of the model. Measured on 2 cores (Intel Xeon,
# AVX-512 with AMX; torch 2.13 CPU, OpenVINO 2026.4), from the trials of three real runs: the
# quickstart's MLP (85 thousand parameters), a light CNN on JPEG photos (142 thousand) and
# all-MiniLM-L6-v2 on real text (22.7 million).
# - compile: torch.compile's first compile (``compile_s``): the MLP 17-29 s, MiniLM on trimmed
#   lengths 52-57 s.
# - openvino: ``convert_model`` and ``compile_model`` (``ov_convert_s``): the MLP 0.6 s, the CNN
#   1.3 s, MiniLM 2.1-5.0 s. Priced as a heavy build before (the baseline's trial and the larger
#   of 15 s and three of them: 56 s for MiniLM), a budget never ran OpenVINO (a 7-s trial), the
#   Hugging Face pipeline's winner.
# - onnxruntime, torchscript: the ONNX export (dynamo and onnxslim) and the TorchScript trace,
#   not in those runs' spaces: taken as twice and as half OpenVINO's conversion, which captures
#   the same graph; the first trial that exports replaces the guess with its ``onnx_export_s``.
# - calibrate: NNCF's calibration and the fallback's ranking (``int8_made_s``): the MLP 2.5 s,
#   the CNN 5.4 s, MiniLM 16.8-22.0 s.
# - prune: a structural pruning and its fine-tuning steps: the heavy build's old prior.
FIRST_BUILD_S = {
    "compile": (20.0, 1.5),
    "openvino": (1.0, 0.2),
    "onnxruntime": (2.0, 0.4),
    "torchscript": (0.5, 0.1),
    "calibrate": (3.0, 0.8),
    "prune": (HEAVY_PRIOR_S, 0.0),
}
# The trial attribute that says what each part cost where a trial made it.
_PART_SECONDS = {"compile": "compile_s", "openvino": "ov_convert_s", "onnxruntime": "onnx_export_s",
                 "calibrate": "int8_made_s", "prune": "build_s", "torchscript": "build_s"}  # fmt: skip


def _cheap_part(base: Mapping[str, Any]) -> dict[str, Any]:
    """The baseline's values of the knobs that price a build: a configuration without its builds."""
    return {k: base[k] for k in PRICE_KNOBS if k in base}


def _parts(kind: tuple[Any, ...]) -> list[str]:
    """What a build of ``kind`` is made of: a compile, a runtime's conversion, a calibration, a pruning.

    Example:
        >>> _parts((("runtime", "openvino"), ("ov_precision", "int8_static")))
        ['openvino', 'calibrate']
        >>> _parts((("compile_mode", "default"),)), _parts((("prune_ratio", 0.3),))
        (['compile'], ['prune'])
    """
    knobs = dict(kind)
    parts = ["compile"] if knobs.get("compile_mode", "none") != "none" else []
    if knobs.get("runtime", "torch") in FIRST_BUILD_S:
        parts.append(knobs["runtime"])
    if _calibrates(kind):
        parts.append("calibrate")
    if knobs.get("prune_ratio") or knobs.get("finetune_steps"):
        parts.append("prune")
    return parts


def _part_s(part: str, measured: Sequence[Mapping[str, Any]], baseline: Mapping[str, Any]) -> float:
    """Seconds ``part`` of a build costs: the most a trial that made it took (its own attribute),
    else its prior for the baseline's parameter count (:data:`FIRST_BUILD_S`)."""
    key = _PART_SECONDS[part]
    made = [
        float(r[key])
        for r in measured
        if r.get(key) and part in _parts(_kind(r["config"], (baseline.get("config") or {})))
    ]
    if made:
        return max(made)
    fixed, per_million = FIRST_BUILD_S[part]
    return fixed + per_million * float(baseline.get("n_params") or 0.0) / 1e6


def build_s(record: Mapping[str, Any]) -> float:
    """Seconds a trial spent building (the model's copy, a pruning, an export: ``build_s``) and
    warming up (compiling: ``compile_s``), before its clock started.

    Example:
        >>> build_s({"build_s": 2.0, "compile_s": 0.5}), build_s({"compile_s": 30.0})
        (2.5, 30.0)
    """
    return float(record.get("build_s") or 0.0) + float(record.get("compile_s") or 0.0)


def rebuild_s(record: Mapping[str, Any]) -> float:
    """Seconds building ``record``'s configuration again takes in the run's workers (a
    confirmation's, the export's): its trial's :func:`build_s` less what the run's caches keep,
    the int8 model NNCF made (``int8_made_s``) and the OpenVINO conversion (``ov_convert_s``)
    where its trial made them rather than read them.
    Priced with it, a Hugging Face budget's int8 pick needed 32 s to confirm where 31 s were
    left, and was not confirmed; its export, 50 s by that price, took 15.

    Example:
        >>> made = {"build_s": 13.0, "compile_s": 0.1, "int8_made_s": 10.0}
        >>> round(rebuild_s(made), 1), round(rebuild_s({**made, "int8_cached": True}), 1)
        (3.1, 13.1)
    """
    return max(0.0, build_s(record) - cached_s(record))


def cached_s(record: Mapping[str, Any]) -> float:
    """Seconds of ``record``'s trial that the run's caches keep from a rebuild: the OpenVINO
    conversion, the ONNX export and the int8 model it made and put in the cache (0 where it
    read them there)."""
    made = 0.0 if record.get("int8_cached") else float(record.get("int8_made_s") or 0.0)
    made += 0.0 if record.get("onnx_cached") else float(record.get("onnx_export_s") or 0.0)
    return made + (0.0 if record.get("ov_converted_cached") else float(record.get("ov_convert_s") or 0.0))


def measure_s(record: Mapping[str, Any]) -> float:
    """Seconds one measurement of a trial's configuration took: its timed windows, and what
    each measurement costs around them (warm-up batches, the loader's start), so what one
    confirmation round of it costs. Its wall time less its build and guard, over the times it
    was measured; its timed windows alone where that is unknown.

    Example:
        >>> measure_s({"wall_s": 12.0, "timed_s": 2.0, "build_s": 1.0, "compile_s": 3.0, "guard_s": 2.0})
        6.0
        >>> measure_s({"wall_s": 12.0, "timed_s": 2.0, "n_measurements": 3}), measure_s({"timed_s": 2.0})
        (3.0, 2.0)
    """
    timed = float(record.get("timed_s") or 0.0)
    wall = float(record.get("wall_s") or 0.0)
    if not wall:
        return timed
    around = (wall - build_s(record) - float(record.get("guard_s") or 0.0)) / max(
        1, int(record.get("n_measurements") or 1)
    )
    # No more than its windows, its warm-up and a second: a baseline's trial also computes the
    # reference outputs, and priced from its wall time it left a 3-minute budget's search one trial.
    return max(timed, min(around, timed + float(record.get("compile_s") or 0.0) + 1.0))


def round_s(record: Mapping[str, Any]) -> float:
    """Seconds one confirmation round of ``record``'s configuration is priced at: its
    measurement's overhead (warm-up batches, the loader's start) and :data:`ROUND_PRICE_WINDOWS`
    of its trial's timed windows (a trial times five).

    Example:
        >>> round_s({"wall_s": 12.0, "timed_s": 2.0, "n_windows": 5, "build_s": 1.0, "compile_s": 3.0, "guard_s": 2.0})
        4.8
        >>> round_s({"timed_s": 2.0})  # windows unknown: the trial's
        2.0
    """
    timed = float(record.get("timed_s") or 0.0)
    windows = int(record.get("n_windows") or 0)
    share = min(1.0, ROUND_PRICE_WINDOWS / windows) if windows else 1.0
    return round(max(0.0, measure_s(record) - timed) + share * timed, 6)


def finish_s(
    baseline: Mapping[str, Any] | None,
    best: Mapping[str, Any] | None,
    start_s: float | None,
    *,
    diagnose: bool = True,
    n_rounds: int = FINISH_ROUNDS,
    n_processes: int = FINISH_PROCESSES,
    exports: bool = True,
) -> float:
    """Predicted seconds of a run's finish with ``best`` as the pick: the confirmation
    processes' worker starts (the second beside the first: :data:`SPARE_START`), both builds in
    each, ``n_rounds`` rounds of both (with the diagnosis, which times the loader and the model
    apart in the first process's first round, half a round more), then the export of the pick
    (:func:`export_s`). 0 before the baseline was
    measured. A round is priced by :func:`round_s`: its measurement's overhead and
    :data:`ROUND_PRICE_WINDOWS` of a trial's five windows. Priced as a whole
    trial measurement, pre-padded budgets ended 6-29 s early, and a 90-s budget of the Hugging
    Face pipeline kept 45 s for a finish that took 10.

    Example:
        >>> base = {"wall_s": 4.0, "timed_s": 2.0, "compile_s": 0.5, "guard_s": 1.5}
        >>> pick = {"wall_s": 30.0, "timed_s": 2.0, "compile_s": 20.0, "guard_s": 8.0}
        >>> finish_s(base, pick, 3.0)
        116.4
        >>> finish_s(base, pick, 3.0, diagnose=False, exports=False)
        56.9
    """
    if baseline is None or not baseline.get("wall_s"):
        return 0.0
    best = best or baseline
    start = float(start_s or 0.0)
    # The second process starts beside the first (a spare), at about a third of a start more.
    starts = start * (1.0 + SPARE_START * max(0, n_processes - 1))
    builds = rebuild_s(baseline) + rebuild_s(best)
    both = round_s(baseline) + round_s(best)
    # The diagnosis times the loader and the model apart in the first process's first round:
    # their windows are shorter, about half a round.
    rounds = n_rounds * both + (0.5 * both if diagnose else 0.0)
    return starts + n_processes * builds + rounds + (export_s(best) if exports else 0.0)


# An export (ONNX, TorchScript, each with its parity check over the validation samples) costs
# about this many of the pick's trials. A real MiniLM pick's took 20-26 s against 10-13 s for its
# trial with a cache per run (priced at one trial, a 3-minute budget ended 10% past its time);
# with the machine's cache it took 15-17 s in a first run and 5-8 s in later ones (picks whose
# trials took 9-15 s), and priced at two trials a 90-s budget stopped searching at 43 s and
# ended at 65 s. The trial is counted as measured once (:func:`once_s`): an export measures
# nothing, and a recipe whose windows disagreed was measured three times (15 s for a 5-s trial),
# which left a 90-s budget's confirmation 12 s of the 23 it needed, and the run ended at 55 s.
EXPORT_TRIALS = 1.25


def export_s(best: Mapping[str, Any]) -> float:
    """Predicted seconds of exporting ``best``: its build again (uncompiled: no file format
    carries a compile) and :data:`EXPORT_TRIALS` of its trial's wall time, measured once.

    Example:
        >>> export_s({"wall_s": 12.0, "build_s": 0.5, "compile_s": 0.5})
        16.0
        >>> export_s({"wall_s": 30.0, "compile_s": 8.0, "config": {"compile_mode": "default"}})
        27.5
        >>> round(export_s({"wall_s": 15.0, "timed_s": 4.0, "n_measurements": 3, "build_s": 0.5, "compile_s": 0.5}), 1)
        8.1
    """
    # The trial's own wall time less what the run's caches keep (NNCF's int8 model).
    export = rebuild_s(best) + EXPORT_TRIALS * (once_s(best) - cached_s(best))
    if (best.get("config") or {}).get("compile_mode", "none") != "none":
        export -= (1 + EXPORT_TRIALS) * float(best.get("compile_s") or 0.0)  # exported uncompiled
    return max(0.0, export)


def selection_s(finalists: Sequence[Mapping[str, Any]], n_rounds: int = 2) -> float:
    """Predicted seconds of selection rounds among ``finalists`` in a worker that is running:
    every build, then ``n_rounds`` rounds of each finalist (the baseline is not timed in them).

    Example:
        >>> fast = {"wall_s": 8.7, "timed_s": 4.1, "compile_s": 0.3, "guard_s": 1.0}
        >>> round(selection_s([fast, fast]), 1)  # builds 0.6, rounds 2 x (2 x 5.4)
        22.2
    """
    builds = sum(rebuild_s(f) for f in finalists)
    return builds + n_rounds * sum(measure_s(f) for f in finalists)
