"""Result files and summary tables: ``best_config.json``, ``trials.csv`` and the terminal table."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from autotune.knobs import REGISTRY

__all__ = [
    "COMPARE_NOTE",
    "SCHEMA_VERSION",
    "METRIC_KEYS",
    "SUMMARY_FIELDS",
    "TRAIN_KEYS",
    "best_by",
    "busy_note",
    "claim_text",
    "compare_text",
    "write_trials_csv",
    "write_json",
    "int8_lines",
    "pipeline_note",
    "summary_fields",
    "summary_rows",
    "trials_sentence",
]

SCHEMA_VERSION = 1
METRIC_KEYS = (
    "samples_per_s",
    "samples_per_s_min",
    "samples_per_s_max",
    "cov",
    "latency_ms_p50",
    "latency_ms_p95",
    "peak_mem_mib",
    "size_bytes",
    "size_bytes_compressed",
    "n_params",
    "macs",
    "compile_s",
    "metric",
    "metric_drop",
)
# What a training-mode trial adds: the step's shape and the loss curve its guard judged.
TRAIN_KEYS = (
    "accumulation_steps",
    "effective_batch_size",
    "loss_first",
    "loss_final",
    "loss_rel_change",
    "skipped_steps",
)


_STATUSES = ("ok", "infeasible", "stopped", "oom", "timeout", "crash", "error", "interrupted")
_NOT_RUN_KINDS = ("screened", "oom-rule", "fault-rule")  # failures decided by a rule, not a measurement


def _measured(record: dict[str, Any]) -> bool:
    """Whether a trial was measured: what counts against ``n_trials``, as the search counts it."""
    if record.get("repeat_of") not in (None, "") or record.get("status") in (None, "", "skipped", "interrupted"):
        return False
    if "ran" in record and record["ran"] not in (None, ""):
        return record["ran"] in (True, "True", "true")
    # trials.csv of a run written before it had the "ran" column: a finished status, not by a rule
    return record["status"] in _STATUSES and record.get("kind") not in _NOT_RUN_KINDS


def trial_counts(records: list[dict[str, Any]]) -> dict[str, Any]:
    """How many of a study's trials were measured (the count ``n_trials`` budgets and the
    terminal shows), by status; how many repeated an already measured configuration and were
    answered from it; how many were not measured at all (ruled out, skipped or unfinished).

    Example:
        >>> recs = [{"status": "ok", "ran": True}, {"status": "ok", "ran": False, "repeat_of": 0}, {"status": "skipped"}]
        >>> trial_counts(recs)
        {'n_measured': 1, 'by_status': {'ok': 1}, 'n_repeats': 1, 'n_not_measured': 1}
    """
    measured = [r for r in records if _measured(r)]
    counts = Counter(r["status"] for r in measured)
    n_repeats = sum(r.get("repeat_of") not in (None, "") for r in records)
    return {
        "n_measured": len(measured),
        "by_status": {s: counts[s] for s in (*_STATUSES, *sorted(set(counts) - set(_STATUSES))) if counts[s]},
        "n_repeats": n_repeats,
        "n_not_measured": len(records) - len(measured) - n_repeats,
    }


def now_iso() -> str:
    """The current time, ISO 8601, UTC."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _atomic_write(path: Path, text: str) -> None:
    # A crash while writing leaves the previous complete file, never half of one.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically."""
    _atomic_write(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def write_trials_csv(path: Path, records: list[dict[str, Any]]) -> None:
    """One row per trial: number, status, kind, reason, every knob, every metric."""
    import io

    columns = [
        "number",
        "status",
        "kind",
        "reason",
        "baseline",
        "ran",
        "repeat_of",
        "retry_of",
        "worker",
        *REGISTRY,
        *METRIC_KEYS,
        *(TRAIN_KEYS if any("loss_final" in r for r in records) else ()),
        "noisy",
        "noise",
        "busy",
        "others_cpu",
        "n_measurements",
        "recompiles",
        "float_bytes",
        "int8_k",
        "trial_s",
        "wall_s",
        "phase",
        "n_windows",
        "fidelity_saved_s",
    ]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for rec in records:
        row = {k: rec.get(k) for k in columns}
        row.update(rec.get("config", {}))
        if not row["status"]:
            row["status"], row["reason"] = _unfinished(rec.get("state"))
        writer.writerow(row)
    _atomic_write(path, buf.getvalue())


def _unfinished(state: str | None) -> tuple[str, str]:
    """(status, reason) of a trial that holds no result: running, queued, or its process died."""
    if state == "RUNNING":
        return "running", "being measured (or its process died; it is failed after the grace period)"
    if state == "WAITING":
        return "queued", "queued, not started"
    return "failed", "its process ended before it recorded a result; its configuration is retried once"


def format_value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("n_params", "macs"):
        return f"{value:,}"
    if key.startswith("size_bytes"):
        return f"{value / 2**20:.2f} MiB"
    if key == "samples_per_s" or (key == "peak_mem_mib" and abs(value) >= 10):
        return f"{value:,.0f}"
    if key == "peak_mem_mib":  # a few MiB: "1" next to "4" would hide a 3.4x change
        return f"{value:.1f}"
    if key.startswith("latency_ms"):
        return f"{value:.2f}"
    if key == "compile_s":
        return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3f}"
    if key in ("metric", "metric_drop"):
        return f"{value:.4f}"
    return str(value)


# (label, metric key) of the summary table's rows, in the terminal and in the reports.
SUMMARY_FIELDS = (
    ("samples/s", "samples_per_s"),
    ("latency p50 (ms/batch)", "latency_ms_p50"),
    ("latency p95 (ms/batch)", "latency_ms_p95"),
    ("peak memory (MiB)", "peak_mem_mib"),
    ("model size", "size_bytes"),
    ("model size, compressed", "size_bytes_compressed"),
    ("parameters", "n_params"),
    ("MACs per sample", "macs"),
    ("compile/warm-up (s)", "compile_s"),
    ("metric", "metric"),
    ("batch size", "batch_size"),
)


# Rows shown only where measured: a run measures compressed sizes only where an objective reads
# them (see autotune.trial.spec.WorkerSpec.sizes).
_IF_MEASURED = ("size_bytes_compressed",)


def summary_fields(baseline: dict[str, Any], best: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, metric key) of the summary table's rows for these figures: :data:`SUMMARY_FIELDS`
    but a row neither measured that is measured only where asked for."""
    return [
        (label, key)
        for label, key in SUMMARY_FIELDS
        if key not in _IF_MEASURED or baseline.get(key) is not None or best.get(key) is not None
    ]


def summary_rows(baseline: dict[str, Any], best: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(label, baseline, best) rows of the summary table."""
    return [
        (label, format_value(key, baseline.get(key)), format_value(key, best.get(key)))
        for label, key in summary_fields(baseline, best)
    ]


# Below these, a figure is mostly the measurement's floor (the allocator's or RSS's granularity, a
# warm-up with nothing to compile), so best / baseline says nothing: the report gives the
# difference instead. (unit, floor)
_DIFFERENCE_BELOW = {"peak_mem_mib": ("MiB", 10.0), "compile_s": ("s", 1.0)}

# What the "change" column means, said under the table in both reports.
COMPARE_NOTE = (
    "The change column is best / baseline, except for the metric and for peak memory under 10 MiB or a "
    "compile/warm-up under 1 s, where it is the difference: a ratio of figures near zero means nothing."
)


def compare_text(key: str, baseline: Any, best: Any) -> str:
    """The summary table's comparison of one row: the ratio best / baseline, or, where either
    figure is near zero (or the row is the metric), the difference with its unit; ``""`` where
    no comparison means anything.

    Example:
        >>> compare_text("samples_per_s", 1000.0, 3300.0)
        '3.30x'
        >>> compare_text("peak_mem_mib", 0.2, 85.4), compare_text("compile_s", 0.005, 3.2)
        ('+85 MiB', '+3.2 s')
        >>> compare_text("peak_mem_mib", 1.05, 3.59), compare_text("compile_s", 0.0013, 0.0072)
        ('+2.5 MiB', '+0.0059 s')
    """
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (baseline, best))
    if not numbers or key == "batch_size":
        return ""
    if key == "metric":
        return f"{best - baseline:+.4f}"
    if key in _DIFFERENCE_BELOW:
        unit, floor = _DIFFERENCE_BELOW[key]
        if min(abs(baseline), abs(best)) < floor:
            diff = best - baseline
            text = f"{diff:+,.0f}" if abs(diff) >= 10 else f"{diff:+.2g}" if abs(diff) < 1 else f"{diff:+.1f}"
            return f"{text} {unit}"
    if not baseline:
        return ""
    return f"{best / baseline:.2f}x"


def trials_sentence(counts: dict[str, Any]) -> str:
    """How many trials a run measured, by status, and what else its study holds, in the words
    the terminal, ``show`` and both reports use (``counts`` from
    :func:`autotune.report.data.trial_counts`).

    Example:
        >>> trials_sentence({"n_measured": 20, "by_status": {"ok": 19, "infeasible": 1}, "n_repeats": 2, "n_not_measured": 0})
        '20 trials measured (19 ok, 1 infeasible); 2 repeats of a configuration already measured were answered from it'
    """
    n = counts["n_measured"]
    by = ", ".join(f"{v} {k}" for k, v in counts["by_status"].items())
    text = f"{n} trial{'' if n == 1 else 's'} measured" + (f" ({by})" if by else "")
    n_rep, n_not = counts.get("n_repeats", 0), counts.get("n_not_measured", 0)
    if n_rep:
        text += (
            f"; {n_rep} repeat{'s' if n_rep != 1 else ''} of a configuration already measured "
            f"{'were' if n_rep != 1 else 'was'} answered from it"
        )
    if n_not:
        text += (
            f"; {n_not} not measured (ruled out by an earlier failure, skipped as a duplicate or over the budget, "
            "or unfinished)"
        )
    return text


def claim_text(speedup: dict[str, Any]) -> tuple[str, str]:
    """(headline, sentence) of a run's speedup entry (best_config.json's ``speedup``): the words
    the terminal, report.md and report.html all use, so they cannot disagree.

    Example:
        >>> claim_text({"verdict": "speedup", "speedup": 2.0, "sentence": "speedup 2.00x (95% CI 1.9-2.1x over 5 rounds)"})
        ('2.00x', 'speedup 2.00x (95% CI 1.9-2.1x over 5 rounds)')
    """
    verdict = speedup.get("verdict")
    if verdict is None:  # a run written before confirmation rounds: its median of pair ratios
        value = speedup.get("median", 1.0)
        return f"{value:.2f}x", f"{value:.2f}x ({speedup.get('method', 'unknown method')})"
    value = speedup.get("speedup", 1.0)
    headline = {
        "speedup": f"{value:.2f}x",
        "none": "none measurable" if speedup.get("method") != "baseline is best" else "1.00x",
        "noisy": "not claimed (busy machine)",
        "slower": "none (the pick was slower)",
        "unconfirmed": f"{value:.2f}x (unconfirmed)",
        "failed": "not measured (the confirmation rounds failed)",
    }.get(verdict, f"{value:.2f}x")
    return headline, speedup.get("sentence", "")


def pipeline_note(out_dir: Any, mode: str | None = None) -> str:
    """Which pipeline a run's throughput figures time, and the one command that re-times it."""
    if mode == "train":
        return "The figures time training steps of the tuned setup, as autotune.training builds it."
    return (
        "The figures time the tuned model fed by the tuned DataLoader (autotune.apply + autotune.dataloader, "
        "the pipeline autotune.predictor runs), end to end; re-time it beside the plain loop and predict in a "
        f"fresh process: python -m benchmarks.predict --cfg CFG.py --load {out_dir} (CFG.py: this run's "
        "model and dataset)"
    )


def busy_note(records: list[dict[str, Any]], speedup: dict[str, Any]) -> str | None:
    """A plain sentence when the run's timings were noisy, saying why: "the machine was busy"
    only where other processes' CPU (or GPU) use was measured above the limit, in at least a
    quarter of the trials (two at least) or in the confirmation rounds; trials whose windows
    merely disagreed are named as such. ``None`` on a clean run.

    Example:
        >>> busy_note([{"ran": True, "samples_per_s": 1.0, "noisy": True, "busy": True}] * 2, {})[:21]
        'The machine was busy:'
        >>> busy_note([{"ran": True, "samples_per_s": 1.0, "noisy": True, "busy": False}] * 2, {})[:34]
        '2 of 2 trials were noisy: their ti'
        >>> busy_note([{"ran": True, "samples_per_s": 1.0, "noisy": i == 0} for i in range(8)], {}) is None
        True
    """
    ran = [r for r in records if r.get("ran") and r.get("samples_per_s") is not None]
    noisy = [r for r in ran if _flag(r.get("noisy"))]
    # A trial stopped early is not measured again, so not marked noisy, but others' load during
    # its windows is measured all the same (of two busy trials, the second was often stopped).
    busy = [r for r in ran if (_flag(r.get("noisy")) or r.get("status") == "stopped") and _busy(r)]
    many = max(2, len(ran) / 4)  # one trial whose windows happened to disagree is not a pattern
    parts = []
    if busy and len(busy) >= many:
        parts.append(
            f"in {len(busy)} of {len(ran)} trials other processes used the CPU (or GPU) even after re-measuring"
        )
    if speedup.get("verdict") == "noisy" and speedup.get("busy", speedup.get("others_cpu", 0.0) > 0.10):
        parts.append(
            f"the confirmation rounds ran beside other processes ({speedup.get('others_cpu', 0):.0%} of the CPU)"
        )
    if parts:
        return (
            "The machine was busy: " + "; ".join(parts) + ". Figures from such a run are unreliable: run "
            "`autotune doctor` to check the load, and tune again on a quiet machine."
        )
    spread = len([r for r in noisy if not _busy(r)])
    if spread and spread >= many:
        return (
            f"{spread} of {len(ran)} trials were noisy: their timed windows disagreed although no other process was "
            "measured busy, so the pipeline's own speed varies (batches of different lengths, a loader that stalls, "
            "recompilation); their figures are less precise. Longer windows (measure={'window_s': 1.0}) average "
            "it out."
        )
    return None


def _flag(value: Any) -> bool:
    return value in (True, "True", "true")


def _busy(record: dict[str, Any]) -> bool:
    """Whether a noisy trial was measured beside other processes (its reason, for a run written
    before the ``busy`` flag)."""
    if record.get("busy") not in (None, ""):
        return _flag(record["busy"])
    return "other process" in str(record.get("noise") or "")


def int8_lines(best: dict[str, Any]) -> list[str]:
    """What the report says of an int8 winner: the layers kept float with their int8 error, the
    weights' size beside fp32, and the CPU's int8 units; nothing for a float winner."""
    int8 = best.get("int8") or {}
    if not int8:
        return []
    lines = []
    if int8.get("method"):
        scales = "per output channel" if int8.get("per_channel") else "per tensor"
        lines.append(f"INT8: {int8['method']} on {int8.get('runtime', 'torch')}, weights scaled {scales}.")
    kept, errors = int8.get("kept_float") or [], int8.get("kept_error") or {}
    if int8.get("n_layers"):
        named = ", ".join(f"{n} ({errors[n]:.3g})" if isinstance(errors.get(n), (int, float)) else n for n in kept)
        lines.append(
            f"INT8 layers kept float: {len(kept)} of {int8['n_layers']}, most sensitive first"
            + (f": {named}" if kept else "")
            + " (in brackets, each one's relative output error with it alone in int8)."
        )
    if int8.get("float_bytes") and int8.get("bytes"):
        lines.append(f"Weights: {int8['bytes'] / 2**20:.2f} MiB, {int8['float_bytes'] / 2**20:.2f} MiB in float32.")
    isa = (best.get("env") or {}).get("cpu_isa")
    if isa is not None:
        units = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in isa]
        lines.append(
            "CPU int8 units: "
            + (", ".join(units) if units else "none (no VNNI or AMX: int8 products run on AVX2/AVX-512 without them)")
            + "."
        )
    return lines


def best_by(records: list[dict[str, Any]], knob: str) -> dict[Any, dict[str, Any]]:
    """For each value of ``knob`` among the trials that passed the guard, the fastest trial."""
    best: dict[Any, dict[str, Any]] = {}
    for rec in records:
        if rec.get("status") != "ok" or "samples_per_s" not in rec:
            continue
        value = rec.get("config", {}).get(knob)
        if value not in best or rec["samples_per_s"] > best[value]["samples_per_s"]:
            best[value] = rec
    return best
