"""``fix``: the knobs the user pins hold in every candidate and in the result."""

import json

import pytest

import autotune
from tests.models import MLP, classification_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_a_fixed_value_holds_in_the_winner_even_when_no_candidate_beats_the_baseline(tmp_path):
    """Batches of one sample are slower than the baseline's 32 on any CPU, so the baseline stood
    and the result ignored the fixed value; the baseline is only the reference of the claim."""
    result = autotune.optimize(
        MLP(),
        classification_data(128),
        space={"base": None, "num_workers": [0, 1]},
        fix={"batch_size": 1},
        n_trials=3,
        out_dir=tmp_path,
        export=(),
        device="cpu",
        isolation="inprocess",
        measure=FAST,
        n_verify_pairs=2,
    )
    trials = [t.user_attrs for t in result.study.trials]
    assert all(t["config"]["batch_size"] == 1 for t in trials if not t.get("baseline"))
    assert result.best_config["batch_size"] == 1 and result.baseline["batch_size"] == 32
    saved = json.loads((tmp_path / "best_config.json").read_text())
    assert saved["config"]["batch_size"] == 1 and saved["baseline_config"]["batch_size"] == 32
    assert saved["speedup"]["method"] != "trial ratio, not confirmed"  # the claim was measured, and says what it found
