"""What a run writes and shows: result files, trials.csv, the summary, report.html and report.md, the dashboard."""

from autotune._lazy import exports

__all__, __getattr__, __dir__ = exports(
    __name__,
    {
        "write_reports": "html",
        "render_html": "html",
        "render_markdown": "markdown",
        "load_run": "data",
        "load_result": "data",
        "write_json": "summary",
        "write_trials_csv": "summary",
        "claim_text": "summary",
        "run_dashboard": "dashboard",
    },
)
