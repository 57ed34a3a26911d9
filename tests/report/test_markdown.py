"""report.md of a real finished run: the findings as Markdown tables and sentences."""

import json

from autotune.report.data import load_run
from autotune.report.markdown import render_markdown


def test_report_md_holds_the_summary_diagnosis_failures_and_artifacts(finished_run):
    text = (finished_run / "report.md").read_text()
    best = json.loads((finished_run / "best_config.json").read_text())
    assert text.startswith("# autotune report: ")
    assert "**Speedup: " in text and best["speedup"]["sentence"] in text
    for heading in ("## Baseline vs best", "## Why it won", "## Trials", "## Artifacts", "## Environment"):
        assert f"\n{heading}\n" in text
    assert "| samples/s |" in text and "| latency p95 (ms/batch) |" in text
    assert (best["diagnosis"].get("summary") or best["diagnosis"]["fault"])[1:] in text
    assert "| loader alone (samples/s) | model alone (samples/s) | bound |" in text
    failed = [r for r in load_run(finished_run).records if r["status"] != "ok" and not r.get("repeat_of")]
    for rec in failed:  # every failure with its reason (a "|" in it escaped for the table)
        reason = rec["reason"].replace("|", "\\|")
        assert f"| {rec['number']} | {rec['status']} | {rec['kind']} | {reason} |" in text
    assert "| onnx | model.onnx | ok |" in text and "| torchscript | model.pt | ok |" in text
    assert "## Pareto front" not in text  # one objective


def test_report_md_says_when_the_diagnosis_is_missing(finished_run):
    run = load_run(finished_run)
    run.best = {**run.best, "diagnosis": {"error": "TrialError: diagnose failed in the worker"}}
    assert "Not measured: TrialError: diagnose failed in the worker." in render_markdown(run)


def _near_zero(run):
    # The quickstart's figures: the CPU peak memory and the warm-up of an eager model are near zero.
    base = {**run.best["baseline"], "peak_mem_mib": 0.2, "compile_s": 0.005}
    best = {**run.best["best"], "peak_mem_mib": 85.4, "compile_s": 3.2}
    run.best = {**run.best, "baseline": base, "best": best}
    return run


def test_figures_near_zero_are_compared_as_differences(finished_run):
    text = render_markdown(_near_zero(load_run(finished_run)))
    assert "| peak memory (MiB) | 0.2 | 85 | +85 MiB |" in text
    assert "| compile/warm-up (s) | 0.005 | 3.20 | +3.2 s |" in text
    assert "427.00x" not in text and "640.00x" not in text
