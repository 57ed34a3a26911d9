"""The summary table's words: figures near zero compared as differences, small figures shown
with their digits, and one sentence for the trial count."""

from autotune.report.summary import compare_text, format_value, summary_rows, trials_sentence


def test_near_zero_memory_and_warm_up_are_compared_as_differences():
    # The quickstart's report once read "0 vs 0 MiB ... 18.80x" and a warm-up "644.18x".
    assert compare_text("peak_mem_mib", 0.2, 85.4) == "+85 MiB"
    assert compare_text("peak_mem_mib", 1.05, 3.59) == "+2.5 MiB"
    assert compare_text("compile_s", 0.005, 3.221) == "+3.2 s"
    assert compare_text("compile_s", 2.0, 0.0031) == "-2.0 s"
    assert compare_text("peak_mem_mib", 0.0, 0.0) == "+0 MiB"


def test_large_figures_keep_their_ratio_and_the_metric_its_difference():
    assert compare_text("peak_mem_mib", 400.0, 200.0) == "0.50x"
    assert compare_text("compile_s", 2.0, 30.0) == "15.00x"
    assert compare_text("samples_per_s", 1000.0, 3300.0) == "3.30x"
    assert compare_text("metric", 0.9, 0.895) == "-0.0050"
    assert compare_text("batch_size", 32, 256) == ""
    assert compare_text("size_bytes", None, 10) == ""
    assert compare_text("samples_per_s", 0.0, 10.0) == ""


def test_small_memory_and_warm_up_keep_their_digits():
    assert format_value("peak_mem_mib", 1.05) == "1.1" and format_value("peak_mem_mib", 3.59) == "3.6"
    assert format_value("peak_mem_mib", 85.4) == "85" and format_value("peak_mem_mib", 2048.0) == "2,048"
    assert format_value("compile_s", 0.0013) == "0.001" and format_value("compile_s", 3.221) == "3.22"
    rows = dict(
        (label, (base, best)) for label, base, best in summary_rows({"peak_mem_mib": 0.4}, {"peak_mem_mib": 0.0})
    )
    assert rows["peak memory (MiB)"] == ("0.4", "0.0")


def test_the_trial_count_names_measured_trials_and_repeats_apart():
    counts = {"n_measured": 20, "by_status": {"ok": 19, "infeasible": 1}, "n_repeats": 2, "n_not_measured": 1}
    text = trials_sentence(counts)
    assert text.startswith("20 trials measured (19 ok, 1 infeasible); 2 repeats ")
    assert "1 not measured" in text and "22" not in text
    assert trials_sentence({"n_measured": 1, "by_status": {"ok": 1}}) == "1 trial measured (1 ok)"
