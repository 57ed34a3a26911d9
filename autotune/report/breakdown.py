"""The operator breakdown of a run: where the baseline's and the winner's time went.

Reads the ``profile`` entry of ``best_config.json`` (:mod:`autotune.run.profile`): stacked bars
by stage and by operator family, the top operators before and after, the operators whose share
changed most (for "why it won"), and what still limits the winner, with what could address it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["OPEN_TRACES", "breakdown_figure", "changed_operators", "limits", "top_rows"]

# How to open the traces, said by the report, ``show`` and ``autotune profile``.
OPEN_TRACES = (
    "open a trace in Perfetto UI (https://ui.perfetto.dev, Open trace file) or chrome://tracing (Load); for "
    "TensorBoard's profiler plugin (torch-tb-profiler), copy it as DIR/NAME.pt.trace.json.gz and run "
    "tensorboard --logdir DIR"
)

_STAGE_LABELS = {
    "loader_wait": "loader wait",
    "host_to_device": "copy to device",
    "forward": "forward",
    "output_sync": "output copy + sync",
    "backward": "backward",
    "optimizer_step": "optimizer step",
}
_FAMILY_COLORS = {
    "matmul/linear": "#2563eb",
    "conv": "#0891b2",
    "attention": "#7c3aed",
    "normalisation": "#db2777",
    "elementwise": "#f59e0b",
    "data movement": "#dc2626",
    "quantize/dequantize": "#16a34a",
    "other": "#9ca3af",
}
_STAGE_COLORS = ["#64748b", "#0f766e", "#1e3a8a", "#a16207", "#9d174d", "#4d7c0f"]  # apart from the families
# A share above these names what still limits the winner.
LOADER_LIMIT, FAMILY_LIMIT, MOVEMENT_LIMIT = 0.20, 0.50, 0.25


def _pair(profile: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    if not profile or "baseline" not in profile or "best" not in profile:
        return None
    return profile["baseline"], profile["best"]


def _per_sample_us(summary: Mapping[str, Any], ms: float) -> float:
    return 1e3 * ms / max(1, summary.get("n_samples") or 1)


def breakdown_figure(profile: Mapping[str, Any] | None) -> tuple[Any, str | None]:
    """Two panels of stacked horizontal bars, baseline and winner: the window's time per sample
    by stage, and the operators' time per sample by family."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from autotune.report.figures import style_

    pair = _pair(profile)
    if pair is None:
        why = (profile or {}).get("error") or "this run was not profiled (profile=False, or written before profiling)"
        return None, f"Not profiled: {why}."
    rows = ["winner", "baseline"]  # horizontal bars list from the bottom up
    sums = {"winner": pair[1], "baseline": pair[0]}
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=["by stage (µs per sample)", "operators by family (µs per sample)"],
        horizontal_spacing=0.12,
    )
    stages = list(dict.fromkeys(k for s in pair for k in s["stages"]))
    for i, stage in enumerate(stages):
        values = [_per_sample_us(sums[r], sums[r]["stages"].get(stage, {}).get("ms", 0.0)) for r in rows]
        color = _STAGE_COLORS[i % len(_STAGE_COLORS)]
        name = _STAGE_LABELS.get(stage, stage)
        bar = go.Bar(y=rows, x=values, orientation="h", name=name, marker_color=color, legendgroup="stage")
        fig.add_trace(bar, row=1, col=1)
    for family, color in _FAMILY_COLORS.items():
        values = [_per_sample_us(sums[r], sums[r]["families"].get(family, {}).get("ms", 0.0)) for r in rows]
        if not any(values):
            continue
        shares = [sums[r]["families"].get(family, {}).get("share", 0.0) for r in rows]
        bar = go.Bar(
            y=rows,
            x=values,
            orientation="h",
            name=family,
            marker_color=color,
            legendgroup="family",
            hovertext=[f"{family}: {s:.0%} of operator time" for s in shares],
        )
        fig.add_trace(bar, row=1, col=2)
    fig.update_layout(barmode="stack")
    style_(fig, 300)
    fig.update_layout(margin={"t": 40, "b": 110}, legend={"orientation": "h", "y": -0.25, "yanchor": "top"})
    return fig, None


def top_rows(summary: Mapping[str, Any], n: int = 10) -> list[list[str]]:
    """The table's rows (plain text) for one pipeline's top ``n`` operators: name, family, self
    time per step, share of operator time, calls per step and input shapes."""
    steps = max(1, summary.get("n_steps") or 1)
    return [
        [
            o["name"],
            o["family"],
            f"{o['self_ms'] / steps:.3f}",
            f"{o['share']:.1%}",
            f"{o['calls'] / steps:g}",
            o.get("input_shapes") or "-",
        ]
        for o in summary.get("operators", [])[:n]
    ]


def _shares(summary: Mapping[str, Any]) -> dict[str, float]:
    return {o["name"]: o["share"] for o in summary.get("operators", [])}


def changed_operators(profile: Mapping[str, Any] | None, n: int = 2) -> str | None:
    """A clause naming the operators whose share of operator time changed most from the
    baseline to the winner, and the winner's largest; ``None`` when not profiled or the baseline won.

    Example:
        >>> base = {"operators": [{"name": "aten::addmm", "share": 0.61}, {"name": "aten::relu", "share": 0.2}]}
        >>> best = {"operators": [{"name": "aten::_softmax", "share": 0.4}, {"name": "aten::addmm", "share": 0.18}]}
        >>> changed_operators({"baseline": base, "best": best})
        'aten::addmm went from 61% to 18% of operator time, aten::_softmax from 0% to 40%; the largest cost is now aten::_softmax (40%)'
    """
    pair = _pair(profile)
    if pair is None or profile.get("same"):  # the baseline won: one pipeline
        return None
    before, after = _shares(pair[0]), _shares(pair[1])
    change = {k: abs(after.get(k, 0.0) - before.get(k, 0.0)) for k in set(before) | set(after)}
    names = [k for k in sorted(change, key=lambda k: -change[k])[:n] if change[k] >= 0.01]  # a point at least
    if not names or not pair[1].get("operators"):
        return None
    parts = [
        f"{k} {'went ' if i == 0 else ''}from {before.get(k, 0.0):.0%} to {after.get(k, 0.0):.0%}"
        + (" of operator time" if i == 0 else "")
        for i, k in enumerate(names)
    ]
    top = pair[1]["operators"][0]
    return ", ".join(parts) + f"; the largest cost is now {top['name']} ({top['share']:.0%})"


def limits(profile: Mapping[str, Any] | None) -> list[str]:
    """What still limits the winner, each with its measured share and what could address it."""
    pair = _pair(profile)
    if pair is None:
        return []
    best = pair[1]
    found = []
    wait = best["stages"].get("loader_wait", {}).get("share", 0.0)
    if wait > LOADER_LIMIT:
        found.append(
            f"the winner waits on its loader {wait:.0%} of the time: more DataLoader workers, pinned memory, or "
            "caching decoded samples could address it"
        )
    family, top = max(best["families"].items(), key=lambda kv: kv[1]["share"])
    if top["share"] > FAMILY_LIMIT and family not in ("other", "data movement"):
        found.append(
            f"{family} takes {top['share']:.0%} of the winner's operator time: quantizing it (int8), fusing it or "
            "compiling it (torch.compile) targets that family"
        )
    moving = best["families"].get("data movement", {}).get("share", 0.0)
    if moving > MOVEMENT_LIMIT:
        found.append(
            f"data movement (copies, layout changes, concatenation) takes {moving:.0%} of the winner's operator "
            "time: keep tensors in one layout and dtype, pin memory, or compile to fuse the copies away"
        )
    if best.get("recompiles"):
        found.append(
            f"torch.compile recompiled {best['recompiles']} time(s) in the profiled window: new input shapes; "
            "pad to fixed lengths or use compile_dynamic"
        )
    return found
