"""The report's figures, as plotly figures; optuna.visualization where it has the plot.

Every function returns ``(figure, note)``: the figure, or ``None`` with a note that says why
that plot cannot be made for this run (too few trials, one objective, no study). plotly and
optuna are imported inside the functions: ``import autotune`` stays light.
"""

from __future__ import annotations

import math
from typing import Any

from autotune.report.data import RunFiles

__all__ = [
    "OBJECTIVE_LABELS",
    "diagnosis_figure",
    "history_figure",
    "importance_figure",
    "knobs_figure",
    "log_ticks",
    "pareto_figure",
    "style_",
]

OBJECTIVE_LABELS = {
    "throughput": "samples/s",
    "latency": "latency p95 (ms/batch)",
    "size": "compressed size (bytes)",
    "memory": "peak memory (MiB)",
    "metric": "metric",
}
# Status colours, shared with the page's tables.
COLORS = {"ok": "#2563eb", "infeasible": "#f59e0b", "baseline": "#6b7280", "best": "#16a34a", "model": "#7c3aed"}
_FONT = "system-ui, -apple-system, Segoe UI, Roboto, sans-serif"


def style_(fig: Any, height: int) -> Any:
    """One look for every figure: white template, small margins, the page's font."""
    fig.update_layout(
        template="plotly_white",
        height=height,
        margin={"l": 60, "r": 20, "t": 30, "b": 50},
        font={"family": _FONT, "size": 12},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
        title=None,
    )
    return fig


def log_ticks(low: float, high: float) -> list[float]:
    """Tick values 1, 2, 5 x 10^k covering [low, high]: readable labels on a log axis.

    Example:
        >>> log_ticks(300, 2100)
        [200, 500, 1000, 2000, 5000]
    """
    low, high = max(low, 1e-9), max(high, 1e-9)
    ticks = []
    for exp in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1):
        ticks += [m * 10**exp if exp >= 0 else m / 10**-exp for m in (1, 2, 5)]
    inside = [t for t in ticks if low <= t <= high]
    below = [t for t in ticks if t < low][-1:]
    above = [t for t in ticks if t > high][:1]
    return below + inside + above


def _log_axis(values: list[float]) -> dict[str, Any]:
    """Axis settings: log with 1-2-5 ticks when the values span over 20x, else linear."""
    low, high = min(values), max(values)
    if high <= 20 * max(low, 1e-9):
        return {"type": "linear", "tickformat": "~s"}
    return {"type": "log", "tickvals": log_ticks(low, high), "tickformat": "~s"}


def _complete(study: Any) -> list[Any]:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]


def _first_objective(run: RunFiles) -> tuple[Any, str]:
    """(target for optuna's plots, its label): ``None`` (the study's own value) with one objective."""
    label = OBJECTIVE_LABELS.get(run.objectives[0], run.objectives[0])
    if len(run.objectives) == 1:
        return None, label
    return (lambda t: t.values[0]), label


def history_figure(run: RunFiles) -> tuple[Any, str | None]:
    """Each trial's value of the first objective with the best feasible so far, baseline dashed."""
    import optuna.visualization as vis

    if run.study is None:
        return None, f"The study could not be opened ({run.study_error}); the trials table below is from trials.csv."
    if not _complete(run.study):
        return None, "No trial completed, so there is no history to plot."
    target, label = _first_objective(run)
    try:
        fig = vis.plot_optimization_history(run.study, target=target, target_name=label)
    except Exception as exc:
        return None, f"The history plot could not be made: {type(exc).__name__}: {exc}"
    key = {"throughput": "samples_per_s", "latency": "latency_ms_p95", "memory": "peak_mem_mib"}.get(run.objectives[0])
    base = (run.best.get("baseline") or {}).get(key) if key else None
    if base is not None:
        fig.add_hline(y=base, line_dash="dash", line_color=COLORS["baseline"], annotation_text="baseline")
    fig.update_xaxes(title="trial")
    fig.update_yaxes(title=label)
    return style_(fig, 360), None


def importance_figure(run: RunFiles) -> tuple[Any, str | None]:
    """How much of the variation of the first objective each searched knob explains."""
    import optuna.visualization as vis

    if run.study is None:
        return None, f"The study could not be opened ({run.study_error})."
    done = _complete(run.study)
    varying = {n for n in {n for t in done for n in t.params} if len({repr(t.params.get(n)) for t in done}) > 1}
    if len(done) < 2 or not varying:
        return None, (
            f"Parameter importances need at least two completed trials whose knobs differ; this run has "
            f"{len(done)} completed trial{'s' if len(done) != 1 else ''}"
            f"{' and no knob that varied' if len(done) >= 2 else ''}."
        )
    from optuna.importance import FanovaImportanceEvaluator

    target, label = _first_objective(run)
    try:
        # fANOVA splits the variance of the target among the knobs, whichever way is better:
        # "how much does this knob matter", seeded so that the report is reproducible.
        evaluator = FanovaImportanceEvaluator(seed=0)
        fig = vis.plot_param_importances(run.study, evaluator=evaluator, target=target, target_name=label)
    except Exception as exc:
        return None, f"Parameter importances could not be computed: {type(exc).__name__}: {exc}"
    fig.update_xaxes(title=f"importance for {label}")
    fig.update_yaxes(title="knob")
    return style_(fig, 360), None


def _measured(run: RunFiles) -> list[dict[str, Any]]:
    return [
        r
        for r in run.records
        if r.get("status") in ("ok", "infeasible") and r.get("samples_per_s") and not r.get("repeat_of")
    ]


_KNOB_LABELS = {"ok": "passed the guard", "infeasible": "infeasible (guard failed)"}


def _knob_marker(status: str) -> dict[str, Any]:
    # One marker for the points and their legend entry, so the legend shows what the panels draw.
    return {"color": COLORS[status], "size": 7, "opacity": 0.85, "symbol": "circle"}


def _knob_traces(records: list[dict[str, Any]], name: str) -> list[Any]:
    """A box with its points for the trials that passed the guard, bare points for the rest;
    no legend entries (a box's legend icon is a box, not the points: :func:`_knob_legend`)."""
    import plotly.graph_objects as go

    traces = []
    for status in ("ok", "infeasible"):
        group = [r for r in records if r["status"] == status]
        if not group:
            continue
        traces.append(
            go.Box(
                x=[str(r["config"].get(name)) for r in group],
                y=[r["samples_per_s"] for r in group],
                name=_KNOB_LABELS[status],
                legendgroup=status,
                showlegend=False,
                boxpoints="all",
                jitter=0.4,
                pointpos=0,
                width=0.5,
                marker=_knob_marker(status),
                # The box summarises the trials that passed; infeasible ones are points only.
                line={"width": 1.5 if status == "ok" else 0, "color": COLORS[status]},
                fillcolor="rgba(37,99,235,0.08)" if status == "ok" else "rgba(0,0,0,0)",
                hovertext=[f"trial {r['number']}" for r in group],
            )
        )
    return traces


def _knob_legend(records: list[dict[str, Any]]) -> list[Any]:
    """One legend entry per status present, drawn with the points' own marker."""
    import plotly.graph_objects as go

    return [
        go.Scatter(x=[None], y=[None], mode="markers", name=_KNOB_LABELS[s], legendgroup=s, marker=_knob_marker(s))
        for s in ("ok", "infeasible")
        if any(r["status"] == s for r in records)
    ]


def _tick_depth(labels: list[str], panel_px: float) -> tuple[int, float]:
    """(tick angle, pixels the tick labels take below the axis) for one panel's categories:
    level while they fit side by side, else at -45 degrees, whose depth grows with the longest."""
    char_px = 7.5  # 12 px sans-serif (DejaVu Sans is among the widest): an estimate that errs on room
    longest = max((len(t) for t in labels), default=1)
    if (longest * char_px + 8) * len(labels) <= panel_px:
        return 0, 22.0
    return -45, 16.0 + 0.71 * longest * char_px


def knobs_figure(run: RunFiles) -> tuple[Any, str | None]:
    """One panel per searched knob: measured samples/s by value, every trial a point.

    The panels' spacing is set in pixels from their tick labels, so labels turned to fit never
    run into the title of the panel below, nor the last row's into the figure's edge.
    """
    from plotly.subplots import make_subplots

    records = _measured(run)
    knobs = [
        (name, [str(v) for v in values])
        for name, values in (run.best.get("space") or {}).items()
        if len(values) > 1 and len({repr(r.get("config", {}).get(name)) for r in records}) > 1
    ]
    if not knobs:
        return None, "No searched knob took more than one value among the measured trials."
    cols = min(3, len(knobs))
    rows = math.ceil(len(knobs) / cols)
    panel_h, title_px, h_space = 220.0, 34.0, 0.08
    # The page's figure is about 1100 px wide at a common window width (1280).
    panel_w = 1000 * (1 - h_space * (cols - 1)) / cols
    ticks = [_tick_depth(order, panel_w) for _, order in knobs]
    last = (rows - 1) * cols  # the first panel of the last row, whose labels go into the bottom margin
    gap = max((d for _, d in ticks[:last]), default=0.0) + title_px  # tick labels, then the next row's titles
    plot_h = rows * panel_h + (rows - 1) * gap
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=[n for n, _ in knobs],
        horizontal_spacing=h_space,
        vertical_spacing=gap / plot_h if rows > 1 else 0.0,
    )
    axis = _log_axis([r["samples_per_s"] for r in records])
    for i, (name, order) in enumerate(knobs):
        row, col = i // cols + 1, i % cols + 1
        for trace in _knob_traces(records, name):
            fig.add_trace(trace, row=row, col=col)
        fig.update_xaxes(
            type="category", categoryorder="array", categoryarray=order, tickangle=ticks[i][0], row=row, col=col
        )
        fig.update_yaxes(**axis, row=row, col=col, title="samples/s" if col == 1 else None)
    for trace in _knob_legend(records):
        fig.add_trace(trace, row=1, col=1)
    fig.update_layout(boxmode="overlay")
    top, bottom = 70.0, max(d for _, d in ticks[last:]) + 14
    style_(fig, int(top + plot_h + bottom))
    # The legend sits above the first row's titles, which it would otherwise cover.
    fig.update_layout(margin={"t": top, "b": bottom}, legend={"y": 1 + (title_px + 4) / plot_h, "yanchor": "bottom"})
    return fig, None


def pareto_figure(run: RunFiles) -> tuple[Any, str | None]:
    """The trials on two or three objectives, the Pareto front highlighted."""
    import optuna.visualization as vis

    n = len(run.objectives)
    if n < 2:
        return None, f"One objective ({run.objectives[0]}): the winner is the single best, there is no Pareto front."
    if run.study is None:
        return None, f"The study could not be opened ({run.study_error}); the front from pareto.json is listed below."
    if n > 3:
        return None, f"{n} objectives cannot be drawn in one plot; the front from pareto.json is listed below."
    try:
        fig = vis.plot_pareto_front(run.study, target_names=[OBJECTIVE_LABELS.get(o, o) for o in run.objectives])
    except Exception as exc:
        return None, f"The Pareto plot could not be made: {type(exc).__name__}: {exc}"
    return style_(fig, 420), None


def diagnosis_figure(diagnosis: dict[str, Any] | None) -> tuple[Any, str | None]:
    """Loader alone and model alone, baseline and winner, as horizontal bars."""
    import plotly.graph_objects as go

    if not diagnosis or "best" not in diagnosis:
        why = (diagnosis or {}).get("error") or "this run has no diagnosis"
        return None, f"Not measured: {why}."
    rows = ["winner", "baseline"]
    fig = go.Figure()
    every = [diagnosis[r][f"{side}_samples_per_s"] for r in ("baseline", "best") for side in ("loader", "model")]
    # Horizontal groups stack their first trace at the bottom: model first puts the loader on top.
    for side, color in (("model", COLORS["model"]), ("loader", COLORS["ok"])):
        values = [diagnosis[r if r == "baseline" else "best"][f"{side}_samples_per_s"] for r in rows]
        fig.add_trace(
            go.Bar(
                y=rows,
                x=values,
                orientation="h",
                name=f"{side} alone",
                marker_color=color,
                text=[f"{v:,.0f}" for v in values],
                textposition="auto",
            )
        )
    fig.update_layout(barmode="group", legend={"traceorder": "reversed"})
    # On a linear axis the slower half of a lopsided pipeline would be an invisible sliver.
    axis = _log_axis(every)
    fig.update_xaxes(**axis, title="samples/s" + (" (log scale)" if axis["type"] == "log" else ""))
    return style_(fig, 230), None
