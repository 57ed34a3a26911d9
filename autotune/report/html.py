"""``report.html`` and ``report.md``: what a finished run found, read back from its files.

The HTML report is one self-contained file: plotly.js is embedded, nothing is fetched, so it
opens offline and can be mailed or archived as is. Every section has a stable ``id``
(:data:`SECTIONS`). A ``window.onerror`` handler writes any script error into the page
(``#js-errors``), so a broken figure is visible instead of silently missing.
"""

from __future__ import annotations

import html
import json
import os
import warnings
from pathlib import Path
from typing import Any

from autotune.report.data import RunFiles, changed_knobs, load_run
from autotune.report.page import ONERROR, PAGE, STYLE
from autotune.report.summary import COMPARE_NOTE, int8_lines

__all__ = ["SECTIONS", "render_html", "write_reports", "write_reports_safely"]

SECTIONS = (
    ("summary", "Baseline vs best"),
    ("diagnosis", "Why it won"),
    ("breakdown", "Where the time goes"),
    ("search", "How the search went"),
    ("history", "Optimization history"),
    ("importance", "Parameter importances"),
    ("knobs", "Effect of each knob"),
    ("pareto", "Pareto front"),
    ("trials", "All trials"),
    ("artifacts", "Exported artifacts"),
    ("environment", "Environment"),
)
_NOT_TRIAL_KEYS = ("trial", "config")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _write(path: Path, text: str) -> None:
    # A crash while writing leaves the previous complete file, never half of one.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_reports(out_dir: str | Path, study: Any = None) -> dict[str, Path]:
    """Write ``report.html`` and ``report.md`` into the output directory of a finished run.

    Args:
        out_dir: Where the run wrote ``best_config.json``.
        study: The run's Optuna study when it is already open; else it is loaded from the
            storage named in ``best_config.json``.

    Returns:
        ``{"html": path, "md": path}``.

    Raises:
        InputError: ``out_dir`` holds no ``best_config.json``.

    Example:
        >>> write_reports("autotune-out")["html"]  # doctest: +SKIP
        PosixPath('autotune-out/report.html')
    """
    from autotune.report.markdown import render_markdown

    run = load_run(out_dir, study)
    paths = {"html": run.out_dir / "report.html", "md": run.out_dir / "report.md"}
    _write(paths["html"], render_html(run))
    _write(paths["md"], render_markdown(run))
    return paths


def write_reports_safely(out_dir: str | Path, study: Any = None) -> dict[str, Path]:
    """:func:`write_reports`, but a failure only warns: the run's results are already saved."""
    try:
        return write_reports(out_dir, study)
    except Exception as exc:
        warnings.warn(
            f"The report could not be written ({type(exc).__name__}: {' '.join(str(exc).split())}); the results "
            f"are saved in {out_dir}. Retry with: autotune report {out_dir}",
            RuntimeWarning,
            stacklevel=2,
        )
        return {}


def _figure(fig: Any, name: str) -> str:
    return fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        div_id=f"fig-{name}",
        config={"displaylogo": False, "responsive": True},
    )


def _plot(made: tuple[Any, str | None], name: str) -> str:
    fig, note = made
    return _figure(fig, name) if fig is not None else f'<p class="note">{_e(note)}</p>'


def _section(sid: str, body: str, lead: str = "") -> str:
    title = dict(SECTIONS)[sid]
    lead_html = f'<p class="lead">{lead}</p>' if lead else ""
    return f'<section id="{sid}" class="card"><h2>{_e(title)}</h2>{lead_html}{body}</section>'


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    """A table of already escaped cells."""
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>'


def _tiles(best: dict[str, Any]) -> str:
    from autotune.report.summary import claim_text, format_value

    headline, sentence = claim_text(best.get("speedup") or {})
    base_m, best_m = best.get("baseline") or {}, best.get("best") or {}
    tiles = [("speedup", _e(headline), _e(sentence), "hero")]
    for label, key in (
        ("samples/s", "samples_per_s"),
        ("latency p95 (ms/batch)", "latency_ms_p95"),
        ("metric", "metric"),
    ):
        value, before = format_value(key, best_m.get(key)), format_value(key, base_m.get(key))
        tiles.append((label, _e(value), f"baseline {_e(before)}", ""))
    return "".join(
        f'<div class="tile {cls}"><div class="label">{label}</div><div class="value">{value}</div>'
        f'<div class="sub">{sub}</div></div>'
        for label, value, sub, cls in tiles
    )


def _metrics_table(best: dict[str, Any]) -> str:
    from autotune.report.summary import compare_text, format_value, summary_fields

    base_m, best_m = best.get("baseline") or {}, best.get("best") or {}
    rows = [
        [_e(label), _e(format_value(k, base_m.get(k))), _e(format_value(k, best_m.get(k))), _e(compare_text(k, base_m.get(k), best_m.get(k)))]
        for label, k in summary_fields(base_m, best_m)
    ]  # fmt: skip
    notes = "".join(f'<p class="note">Note: {_e(n)}.</p>' for n in (best.get("trial_figures") or {}).get("notes") or [])
    return (
        _table(["", "baseline", "best", "change"], rows, "metrics")
        + '<p class="note">Samples/s and latencies are those of the confirmation rounds (baseline and winner '
        "interleaved, fresh after the winner was picked), so their ratio is the speedup above; the other rows "
        f"are each trial's own measurement. {_e(COMPARE_NOTE)}</p>" + notes
    )


def _facts(run: RunFiles) -> str:
    from autotune.report.summary import trials_sentence

    best, guard = run.best, run.best.get("guard") or {}
    chips = "".join(f'<span class="chip">{_e(k)}={_e(v)}</span>' for k, v in changed_knobs(best).items())
    facts = [
        f"winner: trial {_e(best.get('trial'))}",
        f"{_e(trials_sentence(run.trial_counts()))}",
        f"stopped by {_e(best.get('stop_reason'))}",
        f"objectives: {_e(', '.join(run.objectives))}",
        f"guard: {_e(guard.get('metric', '?'))} may drop by at most {_e(guard.get('max_metric_drop', '?'))}",
    ]
    held = best.get("held_out")
    if held and "error" not in held:
        facts.append(f"held-out metric ({held['n_samples']} samples): {held['baseline']:.4f} &rarr; {held['best']:.4f}")
    return (
        f'<h3>Changed knobs</h3><div class="chips">{chips or "<span class=chip>none: the baseline won</span>"}</div>'
        '<h3>Run</h3><ul class="facts">' + "".join(f"<li>{f}</li>" for f in facts) + "</ul>"
    )


def _summary(run: RunFiles) -> str:
    from autotune.report.summary import busy_note, pipeline_note

    busy = busy_note(run.records, run.best.get("speedup") or {})
    body = (
        (f'<p class="warn"><strong>{_e(busy)}</strong></p>' if busy else "")
        + f'<div class="tiles">{_tiles(run.best)}</div>'
        f'<p class="note">{_e(pipeline_note(run.out_dir, run.best.get("mode")))}.</p>'
        f'<div class="split"><div>{_metrics_table(run.best)}</div><div>{_facts(run)}</div></div>'
    )
    return _section("summary", body)


def _diagnosis(run: RunFiles) -> str:
    from autotune.report.figures import diagnosis_figure

    diag = run.best.get("diagnosis") or {}
    lead = ""
    if diag.get("fault"):
        lead = "Not shown: " + _e(diag["fault"]) + "."
        diag = {}
    elif diag.get("summary"):
        lead = _e(diag["summary"][0].upper() + diag["summary"][1:]) + "."
    from autotune.report.breakdown import changed_operators

    ops = changed_operators(run.best.get("profile"))
    if ops:
        lead += (" " if lead else "") + "In the profiled windows, " + _e(ops) + "."
    note = (
        '<p class="note">The loader alone: the configured DataLoader, batches moved to the device, no model. '
        "The model alone: one batch already on the device, called again and again. The slower one bounds the "
        "pipeline (within 15% of each other: balanced).</p>"
    )
    return _section("diagnosis", _plot(diagnosis_figure(diag), "diagnosis") + note, lead)


def _breakdown(run: RunFiles) -> str:
    from autotune.report.breakdown import OPEN_TRACES, breakdown_figure, limits, top_rows

    profile = run.best.get("profile") or {}
    body = _plot(breakdown_figure(profile), "breakdown")
    if "best" in profile:
        head = ["operator", "family", "self ms/step", "share", "calls/step", "input shapes"]
        for label, key in (("Baseline", "baseline"), ("Winner", "best")):
            rows = [
                [_e(c) if i != 0 else f'<span class="mono">{_e(c)}</span>' for i, c in enumerate(r)]
                for r in top_rows(profile[key])
            ]
            basis = profile[key].get("time_basis", "")
            body += f"<h3>{label}: top operators by self time ({_e(basis)})</h3>" + _table(head, rows, "ops")
        found = limits(profile)
        if found:
            body += "<h3>What still limits the winner</h3><ul>" + "".join(f"<li>{_e(f)}.</li>" for f in found) + "</ul>"
        traces = ", ".join(f'<span class="mono">{_e(profile[k]["trace"])}</span>' for k in ("baseline", "best"))
        body += f'<p class="note">Traces: {traces} in this folder; {_e(OPEN_TRACES)}.</p>'
    lead = (
        "Each pipeline profiled for a second or two with torch.profiler after the timed rounds (profiling adds its "
        "own overhead, so these are shares, not the run's figures); operator shares are of the operators' self time."
    )
    return _section("breakdown", body, lead)


def _search(run: RunFiles) -> str:
    """The search's phases (trials and seconds each), when the winner was measured, what
    screening left out, and what shortened timings saved."""
    from autotune.report.story import fidelity_line

    story = run.best.get("search") or {}
    if not story.get("phases"):
        return _section("search", '<p class="note">This run recorded no phases (made by an earlier version).</p>')
    rows = [[_e(p["phase"]), str(p["n_trials"]), f"{p['seconds']:.1f}"] for p in story["phases"]]
    body = _table(["phase", "trials", "seconds of trials"], rows)
    found = story.get("found")
    lead = f"Strategy: {_e(story['strategy'])}."
    if found:
        lead += (
            f" The winner (trial {found['trial']}) was measured in the {_e(found['phase'])} phase, after "
            f"{found['after_trials']} trials and {found['after_s']:.0f} s of trials."
        )
    left = story.get("left_out") or []
    if left:
        items = "".join(
            f"<li><code>{_e(', '.join(f'{k}={v}' for k, v in item['changes'].items()))}</code>: measured "
            f"{item['ratio']:.2f}x</li>"
            for item in left
        )
        body += f"<p>Left out after screening (clearly slower; not run again):</p><ul>{items}</ul>"
    fidelity = fidelity_line(story.get("fidelity"))
    if fidelity:
        body += f"<p>{_e(fidelity[0].upper() + fidelity[1:])}.</p>"
    return _section("search", body, lead)


def _pareto(run: RunFiles) -> str:
    from autotune.report.figures import pareto_figure
    from autotune.report.summary import format_value

    body = _plot(pareto_figure(run), "pareto")
    front = (run.pareto or {}).get("front") or []
    if front:
        keys = ["samples_per_s", "latency_ms_p95", "size_bytes_compressed", "peak_mem_mib", "metric", "batch_size"]
        rows = [[_e(m.get("trial")), *(_e(format_value(k, m.get(k))) for k in keys)] for m in front]
        body += "<h3>Feasible Pareto front (pareto.json)</h3>" + _table(["trial", *keys], rows)
    return _section("pareto", body)


def _trials(run: RunFiles) -> str:
    from autotune.report.summary import format_value, trials_sentence

    base_config = run.best.get("baseline_config") or {}
    winner = run.best.get("trial")
    rows = []
    for rec in sorted(run.records, key=lambda r: r.get("number", 0)):
        status = rec.get("status") or rec.get("state", "?").lower()
        config = rec.get("config") or {}
        flags = []
        if rec.get("baseline"):
            flags.append('<span class="flag">baseline</span>')
        if rec.get("number") == winner:
            flags.append('<span class="flag win">winner</span>')
        if rec.get("noisy") in (True, "True", "true"):
            flags.append(f'<span class="flag" title="{_e(rec.get("noise") or "")}">noisy</span>')
        changes = " ".join(
            _e(f"{k}={v}") for k, v in changed_knobs({"config": config, "baseline_config": base_config}).items()
        )
        if rec.get("repeat_of") not in (None, ""):
            reason = f"same configuration as trial {_e(rec['repeat_of'])}, not measured again"
        else:
            reason = _e(rec.get("reason") or "")
        drop = rec.get("metric_drop")
        rows.append([
            _e(rec.get("number")) + " " + "".join(flags),
            f'<span class="status {_e(status)}">{_e(status)}</span>',
            _e(format_value("samples_per_s", rec.get("samples_per_s"))),
            _e(format_value("latency_ms_p95", rec.get("latency_ms_p95"))),
            _e(format_value("peak_mem_mib", rec.get("peak_mem_mib"))),
            _e(f"{drop:+.4f}" if isinstance(drop, (int, float)) else "-"),
            f'<span class="mono">{changes or "-"}</span>',
            f'<span class="reason">{reason}</span>',
        ])  # fmt: skip
    head = ["trial", "status", "samples/s", "p95 ms", "peak MiB", "metric drop", "changes vs baseline", "reason"]
    counts = trials_sentence(run.trial_counts())
    source = "the study" if run.study is not None else "trials.csv (the study could not be opened)"
    return _section("trials", _table(head, rows, "trials"), f"{_e(counts)} &middot; from {_e(source)}")


def _artifacts(run: RunFiles) -> str:
    artifacts = run.best.get("artifacts") or {}
    if not artifacts:
        return _section("artifacts", '<p class="note">No artifacts were exported (export=()).</p>')
    rows = []
    for fmt, art in artifacts.items():
        parity = art.get("parity") or {}
        ok = art.get("status") == "ok"
        size = f"{art['bytes'] / 2**20:.2f} MiB" if art.get("bytes") else "-"
        detail = (art.get("form_note") or "") if ok else (art.get("error") or parity.get("reason") or "unknown")
        if ok:
            detail = ("the measured winner" if art.get("winner") else "NOT the measured winner") + (
                f": {detail}" if detail else ""
            )
        nums = [
            f"{parity[k]:.2g}" if isinstance(parity.get(k), (int, float)) else "-"
            for k in ("max_abs", "rel_l2", "fidelity")
        ]
        rows.append([
            _e(fmt), f'<span class="mono">{_e(art.get("path", "-"))}</span>', _e(size),
            f'<span class="status {"ok" if ok else "error"}">{_e(art.get("status", "?"))}</span>',
            *map(_e, nums), f'<span class="reason">{_e(detail)}</span>',
        ])  # fmt: skip
    head = ["format", "file", "size", "parity", "max abs diff", "rel L2", "fidelity", "note"]
    lead = "Each artifact's outputs on the validation samples against the tuned model's; <code>autotune verify</code> re-checks them on another machine."
    int8 = "".join(f"<p>{_e(line)}</p>" for line in int8_lines(run.best))
    return _section("artifacts", _table(head, rows) + int8, lead)


def _flat(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in _flat(f"{prefix}.{k}" if prefix else k, v)]
    return [(prefix, value)]


def _environment(run: RunFiles) -> str:
    best = run.best
    pairs = _flat("", best.get("env") or {})
    pairs += [
        ("mode", best.get("mode")),
        ("created", best.get("created")),
        ("schema_version", best.get("schema_version")),
    ]
    pairs += _flat("study", best.get("study") or {})
    rows = [[f'<span class="mono">{_e(k)}</span>', _e("-" if v is None else v)] for k, v in pairs]
    half = (len(rows) + 1) // 2
    body = f'<div class="split even">{_table(["", ""], rows[:half], "kv")}{_table(["", ""], rows[half:], "kv")}</div>'
    return _section("environment", body)


def render_html(run: RunFiles) -> str:
    """The whole page for ``run``, plotly.js inline."""
    from plotly.offline import get_plotlyjs

    from autotune.report.figures import history_figure, importance_figure, knobs_figure

    knob_lead = (
        "Measured samples/s of every trial by each searched knob's value (log scale when they span over 20&times;)."
    )
    sections = [
        _summary(run),
        _diagnosis(run),
        _breakdown(run),
        _search(run),
        '<div class="split even">'
        + _section("history", _plot(history_figure(run), "history"), "The first objective of every completed trial; grey points failed the guard.")
        + _section("importance", _plot(importance_figure(run), "importance"), "How much of the variation across completed trials each knob explains (optuna).")
        + "</div>",
        _section("knobs", _plot(knobs_figure(run), "knobs"), knob_lead),
        _pareto(run),
        _trials(run),
        _artifacts(run),
        _environment(run),
    ]  # fmt: skip
    nav = "".join(f'<a href="#{sid}">{_e(title)}</a>' for sid, title in SECTIONS)
    env = run.best.get("env") or {}
    device = env.get("gpu_name") or f"{env.get('device', '?')} ({env.get('cpu_capability') or '?'})"
    title = f"autotune report: {run.out_dir.name}"
    subtitle = f"{_e(device)} &middot; {_e(run.best.get('created', ''))} &middot; {_e(run.out_dir)}"
    return PAGE.format(
        title=_e(title),
        style=STYLE,
        onerror=ONERROR,
        plotly=get_plotlyjs(),
        heading=_e(title),
        subtitle=subtitle,
        nav=nav,
        sections="\n".join(sections),
        data=_e(json.dumps({"sections": [s for s, _ in SECTIONS]})),
    )
