"""A run's time: refinement that stops paying ends the search, and says why."""

import optuna

from autotune.report.story import story_lines
from autotune.search.phases import converged, search_story
from autotune.search.strategy import Staged
from autotune.search.study import make_sampler, run_trials
from benchmarks.replay import TableRunner, configs_of, space_of


def _flat_table():
    """bf16 pays 2x; the batch and threads change nothing measurable (within 1%)."""
    space = space_of({"amp_dtype": ["float32", "bfloat16"], "batch_size": [16, 32, 64, 128, 256, 512],
                      "num_threads": [1, 2], "channels_last": [False, True]})  # fmt: skip

    def speed(c):
        x = 100.0 * (2 if c["amp_dtype"] == "bfloat16" else 1)
        return x * (1 + 0.001 * (c["batch_size"] % 7)) * (1.0 if c["num_threads"] == 2 else 0.999)

    table = {k: {"status": "ok", "samples_per_s": speed(c), "metric_drop": 0.0, "cov": 0.01}
             for k, c in configs_of(space).items()}  # fmt: skip
    return space, table


def test_refinement_that_stops_improving_ends_the_search_and_says_why():
    """A 40-trial budget on a space whose one lever was found in the first trials: TPE's
    proposals after it buy nothing, and the run stops after 5 of them in a row."""
    space, table = _flat_table()
    study = optuna.create_study(direction="maximize", sampler=make_sampler(0))
    why = run_trials(study, TableRunner(table), space, n_trials=40, timeout=None, max_metric_drop=0.01,
                     objectives=["throughput"], extra_attrs={}, strategy=Staged(space, ["throughput"]))  # fmt: skip
    measured = [t for t in study.trials if t.user_attrs.get("ran")]
    assert why == "converged" and len(measured) < 40, (why, len(measured))
    assert "5 refinement trials in a row" in study.user_attrs["converged"]
    records = [{**t.user_attrs, "number": t.number} for t in study.trials]
    assert converged(records, "samples_per_s") is not None
    story = search_story(records, "staged")
    story["converged"] = study.user_attrs["converged"]
    assert any(line.startswith("the search stopped early: 5 refinement") for line in story_lines(story))


def test_an_improving_refinement_runs_on_and_a_gain_within_the_noise_is_none():
    rows = [{"ran": True, "number": i, "status": "ok", "samples_per_s": 100.0 * 1.05**i, "cov": 0.01}
            for i in range(10)]  # fmt: skip
    assert converged(rows, "samples_per_s") is None  # each refinement trial beat the best by 5%
    noisy = [{**r, "samples_per_s": 100.0 + (i % 2) * 4, "cov": 0.06} for i, r in enumerate(rows)]
    assert converged(noisy, "samples_per_s") is not None  # +4% is within a 6% noise
