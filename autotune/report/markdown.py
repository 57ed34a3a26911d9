"""``report.md``: the report's findings as Markdown, for a pull request, a wiki or a terminal.

Tables and sentences only; the figures are in ``report.html``.
"""

from __future__ import annotations

from typing import Any

from autotune.report.data import RunFiles, changed_knobs
from autotune.report.summary import int8_lines

__all__ = ["render_markdown"]

_MAX_TRIAL_ROWS = 15


def _cell(value: Any) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows] + [""]


def _speedup_line(speedup: dict[str, Any]) -> str:
    from autotune.report.summary import claim_text

    headline, sentence = claim_text(speedup)
    return f"**Speedup: {headline}** ({sentence})"


def _summary(run: RunFiles) -> list[str]:
    from autotune.report.summary import (
        COMPARE_NOTE,
        busy_note,
        compare_text,
        format_value,
        pipeline_note,
        summary_fields,
        trials_sentence,
    )

    best = run.best
    base_m, best_m = best.get("baseline") or {}, best.get("best") or {}
    changes = changed_knobs(best)
    lines = [_speedup_line(best.get("speedup") or {}) + ".", "", pipeline_note(run.out_dir, best.get("mode")) + ".", ""]
    busy = busy_note(run.records, best.get("speedup") or {})
    if busy:
        lines += [f"**{busy}**", ""]
    for note in (best.get("trial_figures") or {}).get("notes") or []:
        lines += [f"Note: {note}.", ""]
    lines.append(
        "Changed knobs: " + (", ".join(f"`{k}={v}`" for k, v in changes.items()) or "none, the baseline won") + "."
    )
    lines.append(
        f"Winner: trial {best.get('trial')}; {trials_sentence(run.trial_counts())}; stopped by "
        f"{best.get('stop_reason')}; objectives: {', '.join(run.objectives)}."
    )
    lines += ["", "## Baseline vs best", ""]
    rows = [
        [label, format_value(k, base_m.get(k)), format_value(k, best_m.get(k)), compare_text(k, base_m.get(k), best_m.get(k))]
        for label, k in summary_fields(base_m, best_m)
    ]  # fmt: skip
    lines += _table(["", "baseline", "best", "change"], rows)
    lines += [COMPARE_NOTE, ""]
    held = best.get("held_out")
    if held and "error" not in held:
        lines += [
            f"Held-out metric ({held['n_samples']} samples): baseline {held['baseline']:.4f}, best {held['best']:.4f}.",
            "",
        ]
    return lines


def _diagnosis(run: RunFiles) -> list[str]:
    diag = run.best.get("diagnosis") or {}
    lines = ["## Why it won", ""]
    if diag.get("fault"):
        return [*lines, f"Not shown: {diag['fault']}.", ""]
    if "summary" not in diag:
        return [*lines, f"Not measured: {diag.get('error') or 'this run has no diagnosis'}.", ""]
    lines += [diag["summary"][0].upper() + diag["summary"][1:] + ".", ""]
    rows = [
        [who, f"{d['loader_samples_per_s']:,.0f}", f"{d['model_samples_per_s']:,.0f}", d["bound"]]
        for who, d in (("baseline", diag["baseline"]), ("winner", diag["best"]))
    ]
    return lines + _table(["", "loader alone (samples/s)", "model alone (samples/s)", "bound"], rows)


def _breakdown(run: RunFiles) -> list[str]:
    from autotune.report.breakdown import OPEN_TRACES, changed_operators, limits, top_rows

    profile = run.best.get("profile") or {}
    lines = ["## Where the time goes", ""]
    if "best" not in profile:
        return [*lines, f"Not profiled: {profile.get('error') or 'profile=False, or a run from before profiling'}.", ""]
    ops = changed_operators(profile)
    if ops:
        lines += [f"In the profiled windows, {ops}.", ""]
    stages = [[label, *(f"{s['stages'].get(k, {}).get('share', 0):.0%}" for k in s["stages"])] for label, s in
              (("baseline", profile["baseline"]), ("winner", profile["best"]))]  # fmt: skip
    lines += _table(["stage share", *profile["best"]["stages"]], stages)
    head = ["operator", "family", "self ms/step", "share", "calls/step", "input shapes"]
    for label, key in (("Baseline", "baseline"), ("Winner", "best")):
        lines += [f"{label}: top operators by self time", "", *_table(head, top_rows(profile[key], 5))]
    lines += [f"- {f}." for f in limits(profile)]
    traces = ", ".join(f"`{profile[k]['trace']}`" for k in ("baseline", "best"))
    return [*lines, "", f"Traces: {traces}; {OPEN_TRACES}.", ""]


def _trials(run: RunFiles) -> list[str]:
    from autotune.report.summary import format_value, trials_sentence

    lines = ["## Trials", "", trials_sentence(run.trial_counts()) + ".", ""]
    base = run.best.get("baseline_config") or {}
    measured = [r for r in run.records if r.get("status") == "ok" and not r.get("repeat_of")]
    fastest = sorted(measured, key=lambda r: -(r.get("samples_per_s") or 0))[:_MAX_TRIAL_ROWS]
    rows = [
        [
            f"{r.get('number')}" + (" (noisy)" if r.get("noisy") in (True, "True", "true") else ""),
            format_value("samples_per_s", r.get("samples_per_s")),
            format_value("latency_ms_p95", r.get("latency_ms_p95")),
            " ".join(
                f"{k}={v}" for k, v in changed_knobs({"config": r.get("config") or {}, "baseline_config": base}).items()
            )
            or "(baseline)",
        ]
        for r in fastest
    ]
    if rows:
        lines += [f"Fastest trials that passed the guard (up to {_MAX_TRIAL_ROWS}):", ""]
        lines += _table(["trial", "samples/s", "p95 ms", "changes vs baseline"], rows)
    failed = [r for r in run.records if r.get("status") not in ("ok", None) and not r.get("repeat_of")]
    if failed:
        lines += ["Trials that failed or were infeasible:", ""]
        lines += _table(
            ["trial", "status", "kind", "reason"],
            [[r.get("number"), r.get("status"), r.get("kind") or "-", r.get("reason") or "-"] for r in failed],
        )
    return lines


def _search(run: RunFiles) -> list[str]:
    from autotune.report.story import story_lines

    story = run.best.get("search") or {}
    if not story.get("phases"):
        return []
    rows = [[p["phase"], p["n_trials"], f"{p['seconds']:.1f}"] for p in story["phases"]]
    lines = ["## How the search went", "", *_table(["phase", "trials", "seconds of trials"], rows)]
    return lines + [f"- {line[0].upper()}{line[1:]}." for line in story_lines(story)[1:]] + [""]


def _pareto(run: RunFiles) -> list[str]:
    from autotune.report.summary import format_value

    front = (run.pareto or {}).get("front") or []
    if not front:
        return []
    keys = ["samples_per_s", "latency_ms_p95", "size_bytes_compressed", "peak_mem_mib", "metric"]
    rows = [[m.get("trial"), *(format_value(k, m.get(k)) for k in keys)] for m in front]
    return ["## Pareto front", "", *_table(["trial", *keys], rows)]


def _artifacts(run: RunFiles) -> list[str]:
    artifacts = run.best.get("artifacts") or {}
    if not artifacts:
        return []
    rows = []
    for fmt, art in artifacts.items():
        parity = art.get("parity") or {}
        if art.get("status") == "ok":
            note = f"max abs {parity.get('max_abs', 0):.2g}, rel L2 {parity.get('rel_l2', 0):.2g}"
        else:
            note = art.get("error") or parity.get("reason") or "unknown"
        winner = "yes" if art.get("winner") else f"no: {art.get('form_note') or 'another model'}"
        rows.append([fmt, art.get("path", "-"), art.get("status", "?"), note, winner])
    lines = ["## Artifacts", "", *_table(["format", "file", "status", "parity", "the measured winner"], rows)]
    return [*lines, *int8_lines(run.best), ""] if int8_lines(run.best) else lines


def _environment(run: RunFiles) -> list[str]:
    env = run.best.get("env") or {}
    versions = env.get("versions") or {}
    device = env.get("gpu_name") or f"{env.get('device', '?')} ({env.get('cpu_capability') or '?'})"
    software = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    return ["## Environment", "", f"{device}; {env.get('cpu_count', '?')} CPUs; {software}.", ""]


def render_markdown(run: RunFiles) -> str:
    """The Markdown report of ``run``."""
    lines = [f"# autotune report: {run.out_dir.name}", "", f"Created {run.best.get('created', '?')}.", ""]
    for part in (_summary, _diagnosis, _breakdown, _search, _pareto, _trials, _artifacts, _environment):
        lines += part(run)
    lines += ["Figures (history, importances, effect of each knob): `report.html`.", ""]
    return "\n".join(lines)
