"""The report's figures as plotly objects: the knob panels' legend and spacing."""

from autotune.report.data import load_run
from autotune.report.figures import knobs_figure
from tests.report.test_html import _many_knobs


def test_the_knob_legend_shows_the_points_own_marker(finished_run):
    fig, _ = knobs_figure(_many_knobs(load_run(finished_run)))
    legend = [t for t in fig.data if t.showlegend is not False]
    assert {t.name for t in legend} == {"passed the guard", "infeasible (guard failed)"}
    for entry in legend:
        assert entry.type == "scatter" and entry.mode == "markers"  # a point, not a box's icon
        points = [t for t in fig.data if t.type == "box" and t.legendgroup == entry.legendgroup]
        assert points and all(t.marker.to_plotly_json() == entry.marker.to_plotly_json() for t in points)


def test_turned_tick_labels_get_room_above_the_next_row(finished_run):
    fig, _ = knobs_figure(_many_knobs(load_run(finished_run)))
    layout = fig.layout
    assert layout.xaxis.tickangle == -45  # eleven batch sizes do not fit side by side
    # The gap between the rows holds the longest turned label and the next row's titles.
    top_of_second_row = max(layout.yaxis4.domain)
    gap_px = (min(layout.yaxis.domain) - top_of_second_row) * (layout.height - layout.margin.t - layout.margin.b)
    assert gap_px >= 0.7 * 7 * len("max-autotune-no-cudagraphs") + 30
