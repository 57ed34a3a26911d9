"""report.html of a real finished run, rendered in headless Chromium: no script errors, every
section there, the figures drawn, nothing fetched from the network."""

import os
import shutil
from pathlib import Path

import optuna
import pytest

from autotune.report.data import load_run
from autotune.report.html import SECTIONS, render_html, write_reports, write_reports_safely

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium() -> str:
    path = os.environ.get("AUTOTUNE_TEST_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.skip("no Chromium: install Debian's chromium or set AUTOTUNE_TEST_CHROMIUM to its path")
    return path


def _artifacts() -> Path:
    where = Path(os.environ.get("AUTOTUNE_TEST_ARTIFACTS") or Path(__file__).parents[1] / "artifacts")
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (the dev extra)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def _open(browser, path: Path):
    """Load ``path`` offline; return (page, script errors, requests that left the file)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    remote: list[str] = []
    page.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))

    def route(r):
        if r.request.url.startswith("file:"):
            return r.continue_()
        remote.append(r.request.url)
        return r.abort()

    page.route("**/*", route)
    page.goto(path.resolve().as_uri(), wait_until="load")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0", timeout=15_000)
    errors += page.evaluate("window.autotuneErrors")
    recorded = page.locator("#js-errors").text_content()
    if recorded:
        errors.append(f"#js-errors: {recorded}")
    return page, errors, remote


def test_optimize_wrote_the_reports(finished_run):
    html = (finished_run / "report.html").read_text()
    assert (finished_run / "report.md").is_file()
    assert "<script src" not in html and "<link" not in html  # plotly.js inline: opens offline
    for sid, _ in SECTIONS:
        assert f'<section id="{sid}"' in html


def test_report_renders_without_errors_with_every_section_and_plot(finished_run, browser):
    page, errors, remote = _open(browser, finished_run / "report.html")
    try:
        assert errors == []
        assert remote == []
        for sid, _ in SECTIONS:
            assert page.locator(f"section#{sid}").is_visible(), sid
        for sid in ("history", "importance", "knobs", "diagnosis", "breakdown"):
            assert page.locator(f"#{sid} .js-plotly-plot .main-svg").count() > 0, f"no plot drawn in #{sid}"
        # The operator breakdown: stacked bars, and the top-operators tables of both traces.
        profile = load_run(finished_run).best["profile"]
        breakdown = page.locator("#breakdown").inner_text()
        assert page.locator("#breakdown table.ops").count() == 2
        for key in ("baseline", "best"):
            assert profile[key]["operators"][0]["name"] in breakdown
            assert profile[key]["trace"] in breakdown
        assert "ui.perfetto.dev" in breakdown and "chrome://tracing" in breakdown
        assert "One objective" in page.locator("#pareto").inner_text()
        trials = page.locator("#trials").inner_text()
        records = load_run(finished_run).records
        assert len(page.locator("#trials tbody tr").all()) == len(records)
        failed = [r for r in records if r["status"] != "ok" and not r.get("repeat_of")]
        assert failed, "the run should hold a failed or infeasible trial"
        for rec in failed:
            assert rec["status"] in trials and rec["reason"].split(":")[0] in trials
        assert "model.onnx" in page.locator("#artifacts").inner_text()
        page.screenshot(path=str(_artifacts() / "report.png"), full_page=True)
    finally:
        page.close()


# Pairs of text boxes that overlap in any figure: tick labels, panel titles (annotations) and
# legend entries, each against the others (a rotated tick label's box is its bounding box).
_OVERLAPS = r"""
() => {
  const boxes = (fig, sel) => Array.from(fig.querySelectorAll(sel))
    .filter((e) => (e.textContent || "").trim())
    .map((e) => ({ text: e.textContent, r: e.getBoundingClientRect(), group: e.parentNode.getAttribute("class") }))
    .filter((b) => b.r.width > 0 && b.r.height > 0);
  const hit = (a, b) => a.r.left + 1 < b.r.right && b.r.left + 1 < a.r.right
    && a.r.top + 1 < b.r.bottom && b.r.top + 1 < a.r.bottom;
  const found = [];
  for (const fig of document.querySelectorAll(".js-plotly-plot")) {
    // Every axis's tick labels: the first axis's group is "xtick", the others' "x2tick", "y3tick"...
    const ticks = boxes(fig, "g[class] > text").filter((b) => /^[xy]\d*tick$/.test(b.group));
    const titles = boxes(fig, ".annotation-text");
    const legend = boxes(fig, ".legendtext");
    for (const [one, other] of [[ticks, titles], [ticks, legend], [titles, legend], [titles, titles]]) {
      for (const a of one) for (const b of other) {
        if (a !== b && hit(a, b)) found.push(`${fig.id}: "${a.text}" overlaps "${b.text}"`);
      }
    }
  }
  return found;
}
"""


def _many_knobs(run):
    """``run`` with seven searched knobs, long values among them: two rows of panels, batch sizes
    that must be turned to fit, under the next row's titles."""
    space = {
        "batch_size": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
        "num_workers": [0, 1, 2, 4],
        "compile_mode": ["none", "default", "reduce-overhead", "max-autotune-no-cudagraphs"],
        "amp_dtype": ["none", "bfloat16", "float16"],
        "channels_last": [False, True],
        "num_threads": [1, 2],
        "runtime": ["torch", "onnxruntime"],
    }
    records = []
    for i in range(24):
        config = {k: v[(i + j) % len(v)] for j, (k, v) in enumerate(space.items())}
        status = "infeasible" if i % 5 == 4 else "ok"
        records.append({"number": i, "status": status, "samples_per_s": 1000.0 + 97 * i, "config": config})
    run.best = {**run.best, "space": space}
    run.records = records
    return run


def test_no_figure_label_overlaps_another(finished_run, tmp_path, browser):
    path = tmp_path / "report.html"
    path.write_text(render_html(_many_knobs(load_run(finished_run))), encoding="utf-8")
    page, errors, _ = _open(browser, path)
    try:
        assert errors == []
        assert page.locator("#knobs .js-plotly-plot .main-svg").count() > 0
        assert page.locator("#fig-knobs .annotation-text").count() == 7  # every panel's title drawn
        assert page.evaluate(_OVERLAPS) == []
        page.locator("#knobs").screenshot(path=str(_artifacts() / "report-knobs.png"))
    finally:
        page.close()
    page, errors, _ = _open(browser, finished_run / "report.html")  # the run's own figures
    try:
        assert errors == [] and page.evaluate(_OVERLAPS) == []
    finally:
        page.close()


def test_a_run_without_its_study_still_reports_with_notes(finished_run, tmp_path, browser):
    # Results copied without study.db, and the recorded storage gone: the tables come from
    # trials.csv, and the plots that need the study say so.
    for name in ("best_config.json", "trials.csv"):
        shutil.copy(finished_run / name, tmp_path / name)
    text = (tmp_path / "best_config.json").read_text().replace(str(finished_run), str(tmp_path / "gone"))
    (tmp_path / "best_config.json").write_text(text)
    paths = write_reports(tmp_path)
    page, errors, _ = _open(browser, paths["html"])
    try:
        assert errors == []
        assert "could not be opened" in page.locator("#history").inner_text()
        assert "could not be opened" in page.locator("#importance").inner_text()
        assert page.locator("#trials tbody tr").count() == len(load_run(finished_run).records)
    finally:
        page.close()


def test_importance_needs_two_completed_trials(finished_run):
    run = load_run(finished_run)
    alone = optuna.create_study(directions=[d for d in run.study.directions])
    alone.add_trial(run.study.trials[0])
    run.study, run.records = alone, run.records[:1]
    html = render_html(run)
    assert "Parameter importances need at least two completed trials" in html


def test_the_summary_table_compares_figures_near_zero_as_differences(finished_run):
    from tests.report.test_markdown import _near_zero

    html = render_html(_near_zero(load_run(finished_run)))
    table = html[html.index('<table class="metrics">') :]
    table = table[: table.index("</table>")]
    assert "<td>peak memory (MiB)</td><td>0.2</td><td>85</td><td>+85 MiB</td>" in table
    assert "<td>compile/warm-up (s)</td><td>0.005</td><td>3.20</td><td>+3.2 s</td>" in table
    assert "427.00" not in table and "640.00" not in table


def test_a_report_failure_warns_and_returns_nothing(tmp_path):
    with pytest.warns(RuntimeWarning, match="autotune report"):
        assert write_reports_safely(tmp_path) == {}


@pytest.mark.slow  # an end-to-end run: outside CI's time, run with -m slow
def test_several_objectives_draw_the_pareto_front(tmp_path, browser):
    import autotune
    from tests.models import MLP, classification_data

    autotune.optimize(
        MLP(),
        classification_data(),
        space={"base": None, "batch_size": [8, 16, 32, 64]},
        objectives=("throughput", "latency"),
        n_verify_pairs=1,
        out_dir=tmp_path,
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=4,
        n_val=32,
        device="cpu",
        isolation="inprocess",
        export=(),
    )
    page, errors, _ = _open(browser, tmp_path / "report.html")
    try:
        assert errors == []
        for sid in ("pareto", "history"):
            assert page.locator(f"#{sid} .js-plotly-plot .main-svg").count() > 0, f"no plot drawn in #{sid}"
        assert "pareto.json" in page.locator("#pareto").inner_text().lower()  # the front's table
        page.screenshot(path=str(_artifacts() / "report-pareto.png"), full_page=True)
    finally:
        page.close()
