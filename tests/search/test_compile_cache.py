"""Compiles share one cache across a study's worker processes, and the run says what compiling cost."""

import pytest

from autotune.config import Config
from autotune.report.story import story_lines
from autotune.search.parallel import compile_cache_env, start_runners
from autotune.search.phases import search_story
from autotune.trial.measure import MeasureSettings
from autotune.trial.runner import SubprocessRunner, pickle_spec
from autotune.trial.spec import WorkerSpec
from tests.models import MLP, classification_data


def _spec():
    return WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
                      measure=MeasureSettings(n_windows=2, window_s=0.05, warmup_batches=1))  # fmt: skip


def test_every_worker_of_a_run_is_given_the_runs_compile_cache(tmp_path):
    runners = start_runners(_spec(), None, "subprocess", 120.0, tmp_path / "logs", tmp_path / "cache")
    try:
        env = runners[0]._env
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")
        assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1" and env["TRITON_CACHE_DIR"].startswith(str(tmp_path))
    finally:
        for runner in runners:
            runner.close()


def test_the_story_gives_the_seconds_spent_compiling_and_what_the_cache_served():
    records = [
        {"number": 0, "ran": True, "baseline": True, "wall_s": 2.0, "compile_s": 0.1, "config": {"compile_mode": "none"}},
        {"number": 1, "ran": True, "phase": "screen", "wall_s": 30.0, "compile_s": 25.0,
         "compile_cache_misses": 2, "config": {"compile_mode": "default"}},
        {"number": 2, "ran": True, "phase": "compose", "wall_s": 9.0, "compile_s": 4.0, "compile_cache_hits": 2,
         "config": {"compile_mode": "default"}},
        {"number": 3, "ran": False, "kind": "deadline", "status": "timeout", "config": {"compile_mode": "default"}},
    ]  # fmt: skip
    story = search_story(records, "staged")
    assert story["compile"] == {"n_trials": 2, "seconds": 29.0, "cache_hits": 2, "cache_misses": 2}
    assert story["not_started"] == 1
    lines = story_lines(story)
    assert "compiling: 29 s over 2 compiled trials; 2 of 4 graphs from the compile cache" in lines
    assert any("1 trials not started" in line for line in lines)


@pytest.mark.slow
def test_a_second_compile_of_the_same_graph_in_another_worker_hits_the_cache(tmp_path):
    env = compile_cache_env(tmp_path / "cache")
    config = dict(Config({"batch_size": 8, "compile_mode": "default"}))
    hits = []
    for i in range(2):  # two worker processes, one after the other, as a confirmation's are
        runner = SubprocessRunner(pickle_spec(_spec()), 300.0, tmp_path / f"w{i}.log", env)
        try:
            result = runner.run(config, timeout=300.0)
        finally:
            runner.close()
        assert result.status == "ok", result.reason
        hits.append((result.metrics["compile_cache_hits"], result.metrics["compile_cache_misses"]))
    assert hits[0][1] >= 1 and hits[1][0] >= 1, hits  # built by the first, read by the second


@pytest.mark.slow
def test_a_worker_forked_from_the_runs_server_reads_the_compile_cache_the_first_wrote(tmp_path):
    """A CPU run's later workers fork from a server that imported the compiler's settings before
    any worker ran: it must have read them with the run's cache folder, or a confirmation's
    forked worker compiles its pick cold."""
    env = compile_cache_env(tmp_path / "cache")
    config = dict(Config({"batch_size": 8, "compile_mode": "default"}))
    runner = SubprocessRunner(pickle_spec(_spec()), 300.0, tmp_path / "w.log", env, fork=True)
    try:
        first = runner.run(config, timeout=300.0)
        runner.restart()  # a fork of the server
        second = runner.run(config, timeout=300.0)
    finally:
        runner.close()
    assert first.status == second.status == "ok", (first.reason, second.reason)
    assert first.metrics["compile_cache_misses"] >= 1 and second.metrics["compile_cache_hits"] >= 1, (
        first.metrics,
        second.metrics,
    )


def _openvino_runs(tmp_path, after_each, **options):
    """Two runs of one MLP with OpenVINO fixed on, each in its own output folder: the record of
    each one's OpenVINO trial that ran, ``after_each(out_dir)`` called after each run."""
    import autotune

    records = []
    for run in ("first", "second"):
        result = autotune.optimize(
            MLP(),
            classification_data(256),
            space={"base": None, "runtime": ["torch", "openvino"]},
            fix={"runtime": "openvino"},
            device="cpu",
            out_dir=tmp_path / run,
            n_trials=2,
            n_val=64,
            measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
            n_verify_pairs=1,
            export=(),
            profile=False,
            progress=False,
            **options,
        )
        ran = [t.user_attrs for t in result.study.trials if t.user_attrs.get("config", {}).get("runtime") == "openvino"]
        records.append(next(r for r in ran if r.get("status") == "ok"))
        after_each(tmp_path / run)
    return records


def test_runs_on_one_machine_share_the_cache_unless_told_to_keep_one_each(tmp_path, monkeypatch):
    """A first run of real MiniLM paid its compile (52-57 s) and NNCF's calibration (17-22 s)
    that a warm run did not: runs share one cache per machine (and per torch and OpenVINO
    version); AUTOTUNE_CACHE_DIR=run keeps one per run, a folder moves it."""
    from autotune.search.parallel import machine_cache_dir

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", "run")
    assert machine_cache_dir(tmp_path / "out") == tmp_path / "out" / "compile-cache"
    monkeypatch.delenv("AUTOTUNE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    default = machine_cache_dir(tmp_path / "out")
    assert default.parent == tmp_path / "home-cache" / "autotune" and default.name.startswith("torch-")
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "shared"))
    pytest.importorskip("openvino")

    def per_run_cache_left(out):
        assert not (out / "compile-cache").exists()

    records = _openvino_runs(tmp_path, per_run_cache_left)  # each run with its own worker process
    assert "ov_convert_s" in records[0] and not records[0].get("ov_converted_cached")  # converted by the first
    assert records[1].get("ov_converted_cached") is True  # read by the second
    assert any((tmp_path / "shared").rglob("*")), "nothing was kept in the shared folder"


def test_an_in_process_run_reads_the_conversions_a_run_before_it_made(tmp_path, monkeypatch):
    """With ``isolation="inprocess"`` the trials ran with no cache named: every OpenVINO build
    converted the model again (4-5 s of each build of real MiniLM), where a worker process reads
    the first one's. The caller's environment is left as it was."""
    import os

    pytest.importorskip("openvino")
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "shared"))
    monkeypatch.delenv("AUTOTUNE_OPENVINO_CACHE", raising=False)

    def environment_put_back(out):
        assert "AUTOTUNE_OPENVINO_CACHE" not in os.environ

    records = _openvino_runs(tmp_path, environment_put_back, isolation="inprocess")
    assert "ov_convert_s" in records[0] and not records[0].get("ov_converted_cached")
    assert records[1].get("ov_converted_cached") is True
