"""collect: one winner of a study two workers shared, picked and written once, with no new trial."""

import json
import textwrap

import optuna
import pytest

import autotune
from autotune.cli import main
from autotune.search.study import open_study
from tests.models import MLP, classification_data

OPTIONS = {
    "space": {"base": None, "batch_size": [8, 16, 32, 64]},
    "measure": {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "stop_share": 0},
    "baseline_batch_size": 8,
    "n_val": 64,
    "n_verify_pairs": 1,
    "n_finalists": 3,
    "device": "cpu",
    "isolation": "inprocess",
    "export": (),
    "profile": False,
}
CFG = f"""
from tests.models import MLP, classification_data

model = MLP()
dataset = classification_data()
options = {OPTIONS!r}
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A study two workers shared through one storage, each with its own output directory:
    (cfg.py, storage URL, study name, root directory)."""
    root = tmp_path_factory.mktemp("collect")
    cfg = root / "cfg.py"
    cfg.write_text(textwrap.dedent(CFG))
    # The workers skip their own finish's rounds (no finalists): what they pick is not the test's.
    workers = root / "worker_cfg.py"
    workers.write_text(textwrap.dedent(CFG).replace("'n_finalists': 3", "'n_finalists': 0"))
    url = f"sqlite:///{root / 'shared.db'}"
    for worker, n_trials in (("a", 2), ("b", 4)):  # the second measures what the first left of the budget
        argv = ["run", str(workers), "--join", "--storage", url, "--study", "shared", "--trials", str(n_trials)]
        assert main([*argv, "--out", str(root / worker), "--quiet"]) == 0
    return cfg, url, "shared", root


def _trials(url, name):
    return [(t.number, t.state.name) for t in optuna.load_study(study_name=name, storage=url).trials]


def test_collect_writes_the_one_winner_of_the_workers_trials_and_measures_none(shared, capsys):
    cfg, url, name, root = shared
    before = _trials(url, name)
    out = root / "winner"
    argv = ["collect", str(cfg), "--storage", url, "--study", name, "--out", str(out), "--export", "torchscript"]
    assert main(argv) == 0, capsys.readouterr().err
    assert _trials(url, name) == before, "collect measured or changed trials"

    saved = json.loads((out / "best_config.json").read_text())
    study = optuna.load_study(study_name=name, storage=url)
    by_number = {t.number: t.user_attrs for t in study.trials}
    # The finalists it re-measured are the study's best trials, whichever worker measured them.
    finalists = [row["trial"] for row in saved["finalists"] if not by_number[row["trial"]].get("baseline")]
    ok = [n for n, a in by_number.items() if a.get("status") == "ok" and a.get("ran") and not a.get("baseline")]
    # Worker a measured the baseline and one trial, worker b the other two: whichever of the three
    # run within 8% of the fastest are finalists (FINALIST_SHARE), the fastest first of all.
    from autotune.search.select import FINALIST_SHARE

    speed = {n: by_number[n]["samples_per_s"] for n in ok}
    near = [n for n in ok if speed[n] >= FINALIST_SHARE * max(speed.values())]
    assert len(ok) == 3 and sorted(finalists) == sorted(near)
    assert saved["config"] == by_number[saved["trial"]]["config"]
    assert saved["n_trials"] == len(before) and (out / "model.pt").is_file()
    assert saved["artifacts"]["torchscript"]["status"] == "ok"
    printed = capsys.readouterr().out
    assert "baseline vs best" in printed and "best config:" in printed


def test_the_library_collect_gives_the_same_candidates(shared, tmp_path):
    _, url, name, _ = shared
    before = _trials(url, name)
    result = autotune.collect(MLP(), classification_data(), url, name, out_dir=tmp_path, **OPTIONS)
    assert _trials(url, name) == before
    configs = [t.user_attrs["config"] for t in result.study.trials if t.user_attrs.get("status") == "ok"]
    assert result.best_config in configs and result.study.study_name == name
    assert (tmp_path / "best_config.json").is_file() and result.out_dir == tmp_path


def test_collect_refuses_what_it_cannot_do_in_one_line(shared, tmp_path, capsys):
    cfg, url, name, _ = shared
    with pytest.raises(autotune.ConfigError, match="No study named 'nope'"):
        autotune.collect(MLP(), classification_data(), url, "nope", out_dir=tmp_path, **OPTIONS)
    with pytest.raises(autotune.ConfigError, match="collect sets n_trials itself"):
        autotune.collect(MLP(), classification_data(), url, name, n_trials=3, **OPTIONS)

    # A study measured only on other hardware: its finalists cannot be re-measured here.
    other = f"sqlite:///{tmp_path / 'other.db'}"
    study = open_study(other, "elsewhere", ["throughput"], 0, False, hardware="Other GPU (sm90) x8, driver 1.0")
    attrs = {"config": {}, "key": "k", "baseline": True, "status": "ok", "ran": True}
    study.add_trial(optuna.trial.create_trial(values=[1.0], user_attrs=attrs))
    assert main(["collect", str(cfg), "--storage", other, "--study", "elsewhere", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no trial measured on this machine's hardware" in err
    assert "Other GPU (sm90)" in err

    # A worker still running: collect waits for nobody and says so.
    running = optuna.load_study(study_name=name, storage=url).ask()
    try:
        with pytest.raises(autotune.ConfigError, match=rf"still has 1 running trial\(s\) \({running.number}\)"):
            autotune.collect(MLP(), classification_data(), url, name, out_dir=tmp_path, **OPTIONS)
    finally:
        optuna.load_study(study_name=name, storage=url).tell(running, state=optuna.trial.TrialState.FAIL)
