"""Why a configuration is as fast as it is: the data pipeline alone against the model alone.

The end-to-end measurement (:mod:`autotune.trial.measure`) says how fast the pipeline is, not which
half holds it back. Here each half is timed on its own for one fixed window:

- the loader: iterate the configured DataLoader and move each batch to the device, no model;
- the model: one batch already on the device, called again and again, no loader.

The slower half bounds the pipeline. Knows nothing about Optuna.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from autotune.config import values_of
from autotune.knobs.state import BuildState
from autotune.samples import batch_size_of, tensor_leaves, to_device
from autotune.trial.build import settings_active
from autotune.trial.epochs import batches_vary
from autotune.trial.measure import WHOLE_EPOCH_BATCHES, MeasureSettings, _sync, call_model, timing_batches

__all__ = [
    "BALANCED_MARGIN",
    "FAULT_MARGIN",
    "LAUNCH_BOUND",
    "classify",
    "diagnose_run",
    "diagnose_state",
    "explain",
    "fault",
    "device_bound",
    "launch_ratio",
    "loader_samples_per_s",
    "model_alone",
    "model_from_rounds",
    "model_samples_per_s",
    "window_for",
]

# The model alone is timed over the timed epoch's batches, cycled, up to this many bytes of them.
MODEL_BYTES = 512 * 2**20
# Within this relative margin of each other, neither half clearly bounds the pipeline.
BALANCED_MARGIN = 0.15


def window_for(settings: MeasureSettings) -> float:
    """Seconds to time each half: half of a full measurement's timed span, 0.05 to 1 s."""
    return max(0.05, min(1.0, settings.n_windows * settings.window_s / 2))


def loader_samples_per_s(
    dataset: Any, state: BuildState, window_s: float, warmup_batches: int = 1, seed: int = 0
) -> float:
    """Samples/s of ``state``'s DataLoader over ``dataset``, batches moved to the device, no model.

    The first ``warmup_batches`` (worker start-up) are not timed.
    """
    device = torch.device(state.device)
    batches, _ = timing_batches(dataset, state, warmup_batches, seed)  # the same batches as measure()'s
    try:
        with settings_active(state.settings):
            for _ in range(warmup_batches):
                to_device(next(batches), device, non_blocking=state.non_blocking)
            _sync(device)
            n_samples, start = 0, time.perf_counter()
            while time.perf_counter() - start < window_s:
                batch = next(batches)
                to_device(batch, device, non_blocking=state.non_blocking)
                n_samples += batch_size_of(batch)
            _sync(device)
            return n_samples / (time.perf_counter() - start)
    finally:
        batches.close()  # shuts down the loader's workers


def model_samples_per_s(
    state: BuildState, batches: list[Any], window_s: float, warmup_batches: int = 1, every: bool = True
) -> float:
    """Samples/s of ``state``'s model called again and again on collated ``batches`` in turn.

    The batches (a list of one or more: batches of different lengths cost different times, and
    the longest alone would understate a text model) are moved to the device once, before
    timing. Every batch is run once (but where ``every`` is false: the build ran them all just
    before) and at least ``warmup_batches`` calls (compilation, autotuning) are made before the
    clock starts; the window ends after whole cycles.
    """
    device = torch.device(state.device)
    if not isinstance(batches, list) or not batches:
        raise TypeError("model_samples_per_s takes a non-empty list of collated batches.")
    batches = [to_device(b, device) for b in batches]
    sizes = [batch_size_of(b) for b in batches]
    with settings_active(state.settings), torch.inference_mode():
        for i in range(max(1, warmup_batches, len(batches) if every else 1)):
            call_model(state.model, batches[i % len(batches)])
        _sync(device)
        n_samples, i, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < window_s or i % len(batches):  # whole cycles of the batches
            call_model(state.model, batches[i % len(batches)])
            n_samples += sizes[i % len(batches)]
            i += 1
        _sync(device)  # queued CUDA work is part of the window
        return n_samples / (time.perf_counter() - start)


# Host seconds to issue a call's kernels over the device's seconds to run them: at this share or
# more the device waits on the launches (small batches, small models), where CUDA graphs pay.
LAUNCH_BOUND = 0.8


def launch_ratio(state: BuildState, batch: Any, n_calls: int = 8) -> float | None:
    """On CUDA: the median, over ``n_calls`` calls of ``state``'s model on ``batch`` (already on
    the device), of the host's time to return from the call (it issues the kernels and does not
    wait for them) over the device's time to run them (CUDA events); ``None`` off CUDA.

    Each call starts on an idle device (synchronised before), so the host's time is the
    launches' alone. At :data:`LAUNCH_BOUND` or more the device idles between kernels."""
    device = torch.device(state.device)
    if device.type != "cuda":
        return None
    ratios = []
    with settings_active(state.settings), torch.inference_mode():
        call_model(state.model, batch)  # a warm call: nothing compiles in the timed ones
        for _ in range(n_calls):
            torch.cuda.synchronize(device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            begin.record()
            call_model(state.model, batch)
            end.record()
            host_ms = (time.perf_counter() - start) * 1e3
            torch.cuda.synchronize(device)
            ratios.append(host_ms / max(begin.elapsed_time(end), 1e-6))
    ratios.sort()
    return ratios[len(ratios) // 2]


def device_bound(samples_per_s: float, model_sps: float, launch: float | None, margin: float = BALANCED_MARGIN) -> str:
    """What bounds a pipeline on a device: ``"input-bound"`` when end to end runs clearly below
    the model alone (feeding the device is the limit), else ``"launch-bound"`` when the host's
    launches take at least :data:`LAUNCH_BOUND` of the device's time, else ``"compute-bound"``.

    Example:
        >>> device_bound(3000.0, 11000.0, 0.2)
        'input-bound'
        >>> device_bound(10500.0, 11000.0, 1.4), device_bound(10500.0, 11000.0, 0.1)
        ('launch-bound', 'compute-bound')
    """
    if samples_per_s * (1 + margin) < model_sps:
        return "input-bound"
    return "launch-bound" if launch is not None and launch >= LAUNCH_BOUND else "compute-bound"


def model_alone(
    state: BuildState, dataset: Any, samples_per_s: float, settings: MeasureSettings, seed: int = 0
) -> dict[str, Any]:
    """The model alone on the timed epoch's batches already on the device, beside the end to
    end ``samples_per_s``: ``model_samples_per_s``, ``launch_ratio`` (see :func:`launch_ratio`)
    and ``bound`` (see :func:`device_bound`). A trial on CUDA records it, so every candidate
    says whether its pipeline feeds the chip."""
    taken = _epoch_batches(dataset, state, seed)
    model = model_samples_per_s(state, taken, window_for(settings), settings.warmup_batches)
    device = torch.device(state.device)
    launch = launch_ratio(state, to_device(taken[0], device))
    return {
        "model_samples_per_s": model,
        "launch_ratio": launch,
        "bound": device_bound(samples_per_s, model, launch),
    }


def classify(loader_sps: float, model_sps: float, margin: float = BALANCED_MARGIN) -> str:
    """``"data-bound"`` when the loader alone is the slower half, ``"compute-bound"`` when the
    model is, ``"balanced"`` when they are within ``margin`` of each other.

    Example:
        >>> classify(410.0, 2900.0)
        'data-bound'
        >>> classify(1000.0, 1100.0)
        'balanced'
    """
    if max(loader_sps, model_sps) <= (1 + margin) * min(loader_sps, model_sps):
        return "balanced"
    return "data-bound" if loader_sps < model_sps else "compute-bound"


def diagnose_state(
    state: BuildState, dataset: Any, settings: MeasureSettings, seed: int = 0, warm: bool = False
) -> dict[str, Any]:
    """Time the loader and the model of a built configuration apart; ``warm``: the build has
    just run the batches ``seed`` draws (a confirmation round), so its model half warms up
    ``settings.warmup_batches`` only, not every batch of the epoch once more (the plain Hugging
    Face baseline's epoch, 1.7 s, was most of its first round's diagnosis).

    Returns:
        ``loader_samples_per_s``, ``model_samples_per_s``, ``bound`` (see :func:`classify`;
        ``"launch-bound"`` where the model's half is its kernel launches, on CUDA),
        ``launch_ratio`` (see :func:`launch_ratio`), ``batch_size`` and ``window_s``.
    """
    window = window_for(settings)
    loader = loader_samples_per_s(dataset, state, window, settings.warmup_batches, seed)
    taken = _epoch_batches(dataset, state, seed)
    model = model_samples_per_s(state, taken, window, settings.warmup_batches, every=not warm)
    bound = classify(loader, model)
    launch = launch_ratio(state, to_device(taken[0], torch.device(state.device)))
    if bound == "compute-bound" and launch is not None and launch >= LAUNCH_BOUND:
        bound = "launch-bound"  # the model's half is the host issuing kernels, not the device
    return {
        "loader_samples_per_s": loader,
        "model_samples_per_s": model,
        "launch_ratio": launch,
        "bound": bound,
        "batch_size": state.batch_size,
        "window_s": window,
    }


def model_from_rounds(rounds: list[list[dict[str, Any]]]) -> None:
    """Give the first round's diagnosis of each configuration whose model was not timed alone
    its model's half from the rounds themselves, and take the rounds' model seconds out.

    Where the batches load in the worker's own process on the CPU, each batch's call in a
    round's windows is timed apart from its loading (``model_s`` of ``timed_samples``), so the
    rounds hold the model's own rate over the same batches: timed again alone, the plain Hugging
    Face baseline's epoch was 2 of a 3.8-s diagnosis, for a figure within 2% of this one. The
    rounds after the first are summed, the process's warm ones (an OpenVINO pick's first round
    in a fresh worker ran 12% under its later rounds); a single round stands alone.
    """
    later = rounds[1:] or rounds
    for i, first in enumerate(rounds[0] if rounds else []):
        seconds = [r[i].get("model_s") for r in later]
        if "loader_samples_per_s" in first and "model_samples_per_s" not in first and all(seconds):
            first["model_samples_per_s"] = sum(r[i]["timed_samples"] for r in later) / sum(seconds)
    for row in rounds:
        for c in row:
            c.pop("model_s", None)
            c.pop("timed_samples", None)


def _epoch_batches(dataset: Any, state: BuildState, seed: int) -> list[Any]:
    """The batches the timing reads, as the configuration makes them (its collate, padding and
    grouping): the whole epoch the timing reads (at most WHOLE_EPOCH_BATCHES batches and
    MODEL_BYTES of them, at least one). A sample of them costs what its batches cost: 8 of
    CRAFT's 32 pages of different sizes made its model 20 pages/s against 22 end to end."""
    # Batches of one shape cost the same: one of them is the epoch's model (whole cycles of a
    # pre-padded real-text epoch of 12 made its half 4 s of a 10-s diagnosis).
    n_epoch = min(WHOLE_EPOCH_BATCHES, -(-len(dataset) // state.batch_size)) if batches_vary(dataset, state) else 1
    batches, _ = timing_batches(dataset, state, 0, seed)
    taken: list[Any] = []
    held = 0
    try:
        while len(taken) < n_epoch and (not taken or held < MODEL_BYTES):
            taken.append(next(batches))
            held += sum(t.numel() * t.element_size() for t in tensor_leaves(taken[-1]))
    finally:
        batches.close()
    return taken


def _changed(base: Mapping[str, Any], best: Mapping[str, Any], side: str) -> list[str]:
    from autotune.knobs import REGISTRY, declared

    # Each knob declares the half it changes; the batch size acts on both.
    names = declared("side", side, "both")
    return [
        f"{k}={best[k]}"
        for k in names
        if k in best and base.get(k) != best[k] and (k not in REGISTRY or REGISTRY[k].applies(dict(best)))
    ]


def _side_clause(side: str, before: float, after: float, knobs: list[str]) -> str:
    if not knobs:
        return f"no {side} knob changed (the {side} gave {after:,.0f} samples/s)"
    verb = "raised" if after > 1.05 * before else "lowered" if after < before / 1.05 else "kept"
    return f"{', '.join(knobs)} {verb} the {side} {'at' if verb == 'kept' else 'to'} {after:,.0f}"


def explain(
    baseline: Mapping[str, Any],
    best: Mapping[str, Any],
    baseline_config: Mapping[str, Any],
    best_config: Mapping[str, Any],
) -> str:
    """One sentence: what bounded the baseline, and which knobs of the winner acted on that half.

    Example:
        >>> explain(
        ...     {"loader_samples_per_s": 410, "model_samples_per_s": 2900, "bound": "data-bound"},
        ...     {"loader_samples_per_s": 3100, "model_samples_per_s": 2950, "bound": "balanced"},
        ...     dict(num_workers=0),
        ...     dict(num_workers=4),
        ... )
        'baseline was data-bound: 410 samples/s from the loader vs 2,900 from the model (no loader workers: loading took 88% of its time); num_workers=4 raised the loader to 3,100; the winner is balanced (3,100 vs 2,950)'
    """
    bl, bm = baseline["loader_samples_per_s"], baseline["model_samples_per_s"]
    text = f"baseline was {baseline['bound']}: {bl:,.0f} samples/s from the loader vs {bm:,.0f} from the model"
    if not values_of(baseline_config).num_workers and bm / (bl + bm) >= SERIAL_SHARE:
        # No workers: the loader and the model take turns, so the loader's time adds to the model's.
        text += f" (no loader workers: loading took {bm / (bl + bm):.0%} of its time)"
    if dict(baseline_config) == dict(best_config):
        return text + "; no configuration beat it, so it is also the winner"
    sides = {"data-bound": ["loader"], "compute-bound": ["model"], "launch-bound": ["model"]}.get(
        baseline["bound"], ["loader", "model"]
    )
    for side in sides:
        before, after = baseline[f"{side}_samples_per_s"], best[f"{side}_samples_per_s"]
        text += "; " + _side_clause(side, before, after, _changed(baseline_config, best_config, side))
    wl, wm = best["loader_samples_per_s"], best["model_samples_per_s"]
    return text + f"; the winner is {best['bound']} ({wl:,.0f} vs {wm:,.0f})"


# Without loader workers, a loader that takes at least this share of the time is named.
SERIAL_SHARE = 0.2

# A half alone measured this much slower than the whole pipeline is a measurement fault.
FAULT_MARGIN = 0.10


def _with_bound(figures: Mapping[str, Any]) -> dict[str, Any]:
    loader, model = figures["loader_samples_per_s"], figures["model_samples_per_s"]
    out = {"loader_samples_per_s": loader, "model_samples_per_s": model, "bound": classify(loader, model)}
    if figures.get("samples_per_s") is not None:
        out["samples_per_s"] = figures["samples_per_s"]
    return out


def fault(figures: Mapping[str, Any], label: str) -> str | None:
    """A sentence when a half alone (loader or model) ran slower than the whole pipeline did in
    the same rounds: impossible for a sound measurement, so it is flagged, not explained.

    Example:
        >>> fault({"samples_per_s": 46.0, "loader_samples_per_s": 9000.0, "model_samples_per_s": 15.0}, "baseline")
        "the baseline's model alone ran at 15 samples/s, below its end-to-end 46: a measurement fault, not a finding"
    """
    e2e = figures.get("samples_per_s")
    if not e2e:
        return None
    for half in ("model", "loader"):
        alone = figures.get(f"{half}_samples_per_s")
        if alone is not None and alone < (1 - FAULT_MARGIN) * e2e:
            return (
                f"the {label}'s {half} alone ran at {alone:,.0f} samples/s, below its end-to-end {e2e:,.0f}: "
                "a measurement fault, not a finding"
            )
    return None


def diagnose_run(
    runner: Any,
    baseline: Mapping[str, Any],
    best: Mapping[str, Any],
    confirmed: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Why the winner won; never raises.

    With ``confirmed`` (the confirmation rounds, which time the loader and the model alone in
    the same rounds as the end to end), the figures come from there. Otherwise the baseline and
    the winner are diagnosed in the runner's worker. A half that ran slower than its whole
    pipeline is reported as a measurement ``fault`` instead of a summary.

    Args:
        runner: A :class:`~autotune.trial.runner.Runner` whose worker has a ``diagnose`` call.
        baseline: The baseline's trial record (``config``, ``key``, ``samples_per_s``).
        best: The winner's trial record.
        confirmed: :func:`autotune.run.rounds.confirm`'s result, or ``None``.

    Returns:
        ``{"baseline": {...}, "best": {...}, "summary": sentence}``, or with ``"error"`` (and
        whatever was measured before it) when a measurement failed, or ``"fault"`` when the
        figures contradict the end-to-end ones.
    """
    out: dict[str, Any] = {}
    same = best.get("key") == baseline.get("key")
    try:
        if confirmed is not None and "loader_samples_per_s" in confirmed["baseline"]:
            out["baseline"] = _with_bound(confirmed["baseline"])
            out["best"] = out["baseline"] if same else _with_bound(confirmed["best"])
            out["source"] = "confirmation rounds"
        else:
            out["baseline"] = runner.call("diagnose", dict(baseline["config"]))
            out["baseline"]["samples_per_s"] = baseline.get("samples_per_s")
            out["best"] = out["baseline"] if same else runner.call("diagnose", dict(best["config"]))
            out["best"]["samples_per_s"] = best.get("samples_per_s")
            out["source"] = "separate measurement"
        faults = [f for f in (fault(out["baseline"], "baseline"), None if same else fault(out["best"], "winner")) if f]
        if faults:
            out["fault"] = "; ".join(faults)
        else:
            out["summary"] = explain(out["baseline"], out["best"], baseline["config"], best["config"])
    except Exception as exc:  # the search's result stands without its diagnosis
        out["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return out
