"""A finished run read back from its files: storage resolution, the summary, trials.csv fallback."""

import json
import shutil

import pytest

from autotune import InputError
from autotune.report.data import load_result, load_run, run_summary, storage_of, trial_counts


def _best(tmp_path, storage):
    (tmp_path / "best_config.json").write_text(json.dumps({"study": {"name": "mine", "storage": storage}}))


def test_storage_comes_from_best_config(tmp_path):
    _best(tmp_path, "postgresql://user@db.example/autotune")
    assert storage_of(tmp_path) == ("postgresql://user@db.example/autotune", "mine")


def test_a_moved_sqlite_study_is_found_next_to_best_config(tmp_path):
    _best(tmp_path, "sqlite:////elsewhere/that/is/gone/study.db")
    (tmp_path / "study.db").touch()
    assert storage_of(tmp_path) == (f"sqlite:///{(tmp_path / 'study.db').resolve()}", "mine")


def test_a_study_db_alone_is_enough(tmp_path):
    (tmp_path / "study.db").touch()
    assert storage_of(tmp_path) == (f"sqlite:///{(tmp_path / 'study.db').resolve()}", "autotune")


def test_an_empty_directory_says_what_to_give(tmp_path):
    with pytest.raises(InputError, match=r"No best_config\.json or study\.db in"):
        storage_of(tmp_path)
    with pytest.raises(InputError, match=r"No best_config\.json in .*autotune run --out DIR"):
        load_run(tmp_path)


def test_summary_and_result_match_best_config(finished_run):
    best = json.loads((finished_run / "best_config.json").read_text())
    summary = run_summary(finished_run)
    assert summary["speedup"] == best["speedup"] and summary["config"] == best["config"]
    assert summary["diagnosis"] == best["diagnosis"]
    # The trials measured, as the terminal counts them: the study's repeats and skipped entries apart.
    assert sum(summary["trials_by_status"].values()) == summary["n_trials"] == best["n_measured"]
    assert summary["n_trials"] + summary["n_repeats"] + summary["n_not_measured"] == best["n_trials"]
    assert set(summary["reports"]) == {"report.html", "report.md"}
    json.dumps(summary)  # JSON-safe
    result = load_result(finished_run)
    assert result.speedup == best["speedup"]["speedup"] and result.best_config == best["config"]
    assert result.verdict == best["speedup"]["verdict"] and result.claim == best["speedup"]["sentence"]
    assert result.diagnosis == best["diagnosis"] and len(result.study.trials) == best["n_trials"]


def test_trials_come_from_trials_csv_when_the_study_is_gone(finished_run, tmp_path):
    for name in ("best_config.json", "trials.csv"):
        shutil.copy(finished_run / name, tmp_path / name)
    text = (tmp_path / "best_config.json").read_text().replace(str(finished_run), str(tmp_path / "gone"))
    (tmp_path / "best_config.json").write_text(text)
    run, full = load_run(tmp_path), load_run(finished_run)
    assert run.study is None and run.study_error
    assert [(r["number"], r["status"]) for r in run.records] == [(r["number"], r["status"]) for r in full.records]
    assert run.records[0]["config"] == full.records[0]["config"]


def test_trial_counts_agree_with_the_search_and_survive_trials_csv(finished_run, tmp_path):
    from autotune.search.study import n_measured

    run = load_run(finished_run)
    counts = trial_counts(run.records)
    assert counts["n_measured"] == n_measured(run.study)  # what the progress lines count against n_trials
    assert counts["n_measured"] + counts["n_repeats"] + counts["n_not_measured"] == len(run.study.trials)
    for name in ("best_config.json", "trials.csv"):
        shutil.copy(finished_run / name, tmp_path / name)
    text = (tmp_path / "best_config.json").read_text().replace(str(finished_run), str(tmp_path / "gone"))
    (tmp_path / "best_config.json").write_text(text)
    assert load_run(tmp_path).trial_counts() == counts


def test_trial_counts_of_a_trials_csv_without_the_ran_column():
    # Written before trials.csv said whether a trial ran: finished statuses count, rules and repeats do not.
    records = [
        {"number": 0, "status": "ok", "repeat_of": None},
        {"number": 1, "status": "ok", "repeat_of": 0},
        {"number": 2, "status": "oom", "kind": "oom-rule"},
        {"number": 3, "status": "infeasible", "kind": "guard"},
        {"number": 4, "status": "skipped"},
        {"number": 5, "status": "failed"},
    ]
    assert trial_counts(records) == {
        "n_measured": 2,
        "by_status": {"ok": 1, "infeasible": 1},
        "n_repeats": 1,
        "n_not_measured": 3,
    }
