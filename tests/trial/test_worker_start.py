"""A later worker of a run (a confirmation's fresh process, a restart after a fault) starts
without the baseline's reference, which the first worker made while checking the model and the
data, and makes it only when something reads it: rounds never do."""

import functools

import pytest
import torch

from autotune.batching import pad_collate
from autotune.config import Config
from autotune.errors import InputError
from autotune.trial.inference import TrialContext
from autotune.trial.measure import MeasureSettings
from autotune.trial.spec import WorkerSpec
from tests.models import MLP, TextEncoder, classification_data, text_data

FAST = MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=2, n_remeasure=0)


def _text_spec() -> WorkerSpec:
    return WorkerSpec(
        model=TextEncoder(), dataset=text_data(96), metric=None, device="cpu", baseline=dict(Config({"batch_size": 8})),
        val_indices=list(range(24)), measure=FAST, collate_fn=functools.partial(pad_collate, pad_values={}),
        sequence=True,
    )  # fmt: skip


def test_a_checked_worker_times_rounds_without_the_reference_and_guards_a_trial_as_the_first_did():
    first, later = TrialContext(_text_spec()), TrialContext(_text_spec(), checked=True)
    assert "baseline_metric" in first.info and "baseline_metric" not in later.info
    configs = [dict(Config({"batch_size": 8})), dict(Config({"batch_size": 16, "padding": "trim"}))]
    reply = later.rounds(configs, 1, 1)
    assert len(reply["rounds"]) == 1 and later._reference is None  # timing never read it
    candidate = dict(Config({"batch_size": 16, "padding": "trim", "length_grouping": 4}))
    got, expected = later.run_trial(candidate), first.run_trial(candidate)
    assert got.status == expected.status == "ok" and later._reference is not None
    # The same reference, so the same judgement of the candidate's outputs.
    assert got.metrics["metric_drop"] == pytest.approx(expected.metrics["metric_drop"], abs=1e-9)
    assert later.extras.token_outputs == first.extras.token_outputs


def test_a_checked_worker_makes_the_reference_before_a_build_that_ranks_int8_layers_against_it():
    spec = WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=FAST)  # fmt: skip
    later = TrialContext(spec, checked=True)
    assert later.extras.int8 is None
    later.build(dict(Config({"batch_size": 8, "quantization": "int8_dynamic", "int8_fallback": 1})))
    assert later._reference is not None and later.extras.int8 is not None


def test_a_worker_started_with_what_the_first_learned_builds_an_int8_pick_without_the_reference():
    """A confirmation's fresh workers each ran the baseline over the validation samples before
    building an int8 pick (1.7 s of real MiniLM), only to judge int8 layers as the first worker
    judged them: that judgement now comes with them, so the pick's model is read from the run's
    cache, and the reference waits for a reader that needs it (a guard, the export)."""
    spec = WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=FAST)  # fmt: skip
    first = TrialContext(spec)
    known = first.info["known"]
    assert known["int8"]["kinds"] == first.reference.kinds and known["ragged"] == first.extras.ragged
    later = TrialContext(spec, checked=known)
    config = dict(Config({"batch_size": 8, "quantization": "int8_dynamic", "int8_fallback": 1}))
    later.build(config)
    assert later._reference is None
    plan, theirs = later.extras.int8, first.extras.int8
    assert (plan.kinds, plan.max_drop, plan.budget_s) == (theirs.kinds, theirs.max_drop, theirs.budget_s)
    got, expected = later.run_trial(config), first.run_trial(config)  # the guard makes it, and judges alike
    assert got.status == expected.status and later._reference is not None
    assert got.metrics["metric_drop"] == pytest.approx(expected.metrics["metric_drop"], abs=1e-9)


class _FailsOnTheData(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def test_the_first_worker_still_checks_the_model_on_the_data_before_any_trial():
    spec = WorkerSpec(model=_FailsOnTheData(), dataset=classification_data(32), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(8)), measure=FAST)  # fmt: skip
    with pytest.raises(InputError, match="forward pass failed on the first batch"):
        TrialContext(spec)


def test_a_restarted_worker_process_starts_checked(tmp_path):
    from autotune.trial.runner import SubprocessRunner, pickle_spec

    spec = WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=FAST)  # fmt: skip
    runner = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "worker.log")
    try:
        assert "baseline_metric" in runner.info  # the first start made the reference
        known = runner.info["known"]
        runner.restart()
        assert "baseline_metric" not in runner.info and runner._known == known  # handed to the next
        result = runner.run(dict(Config({"batch_size": 16})))  # a trial makes it when it needs it
        int8 = runner.run(dict(Config({"batch_size": 8, "quantization": "int8_dynamic", "int8_fallback": 1})))
    finally:
        runner.close()
    assert result.status == "ok" and result.metrics["metric_drop"] == pytest.approx(0.0, abs=1e-6)
    assert int8.status in ("ok", "rejected"), (int8.status, int8.reason)


def test_a_spare_worker_starts_beside_a_fresh_one_and_serves_the_next_restart(tmp_path):
    """A confirmation's two fresh workers each took 4 s to start, one after the other. The
    first one starts a spare beside it: the next restart is that spare, already started, a
    process of its own that nothing ran in; closing the runner stops both."""
    import os

    from autotune.trial.runner import SubprocessRunner, pickle_spec

    spec = WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=FAST)  # fmt: skip
    runner = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "worker.log")
    try:
        first = runner._proc.pid
        runner.restart(spare=True)
        fresh, spare = runner._proc.pid, runner._spare[0].pid
        assert len({first, fresh, spare}) == 3 and runner.n_starts == 3
        assert runner.run(dict(Config({"batch_size": 16}))).status == "ok"
        runner.restart()
        assert runner._proc.pid == spare and runner._spare is None and runner.n_starts == 3
        assert runner.run(dict(Config({"batch_size": 16}))).status == "ok"
    finally:
        runner.close()
    for pid in (first, fresh, spare):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class _SaysItsEnvironment(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        print("mark:", os.environ.get("AUTOTUNE_TEST_MARK"), flush=True)
        return super().forward(x)


def test_a_cpu_runs_later_workers_are_forked_from_a_server_with_the_runs_environment(tmp_path):
    """A fresh interpreter's imports (torch, then the modules the model comes from) were most of
    a confirmation worker's 4-s start. A CPU run's later workers fork from a server that
    imported them and ran nothing: each is a process of its own, in its own session, with the
    run's environment for workers (the compile cache's folder), its output in the worker log."""
    import os

    import psutil

    from autotune.trial.runner import SubprocessRunner, pickle_spec

    spec = WorkerSpec(model=_SaysItsEnvironment(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=FAST)  # fmt: skip
    log = tmp_path / "worker.log"
    runner = SubprocessRunner(pickle_spec(spec), 120.0, log, {"AUTOTUNE_TEST_MARK": "forked"}, fork=True)
    try:
        first = runner._proc.pid
        assert psutil.Process(first).ppid() == os.getpid()  # the first is a fresh interpreter
        _wait_ready(tmp_path / "worker-server")  # until then, a restart starts a fresh interpreter
        runner.restart(spare=True)
        fresh, spare = runner._proc.pid, runner._spare[0].pid
        for pid in (fresh, spare):
            assert psutil.Process(pid).ppid() not in (os.getpid(), first) and os.getsid(pid) == pid
        log.write_text("")
        assert runner.run(dict(Config({"batch_size": 16}))).status == "ok"
        assert "mark: forked" in log.read_text()
        runner.restart()
        assert runner._proc.pid == spare and runner.run(dict(Config({"batch_size": 16}))).status == "ok"
        server = psutil.Process(runner._proc.pid).ppid()
        folder = tmp_path / "worker-server"
        assert (folder / "ready").exists() and not (folder / "payload.pt").exists()  # read, then removed
    finally:
        runner.close()
    for pid in (first, fresh, spare, server):  # the run's server stops with its runner
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    again = SubprocessRunner(pickle_spec(spec), 120.0, log, {"AUTOTUNE_TEST_MARK": "again"}, fork=True)
    try:  # the next run in this process starts a server of its own, with its own environment
        _wait_ready(folder)
        again.restart()
        assert psutil.Process(again._proc.pid).ppid() not in (os.getpid(), server)
        log.write_text("")
        assert again.run(dict(Config({"batch_size": 16}))).status == "ok" and "mark: again" in log.read_text()
    finally:
        again.close()


def test_a_forking_runner_prices_a_restart_as_a_fork_not_as_the_first_fresh_interpreter(tmp_path):
    """A budget's finish is planned from what a worker start costs. Priced at the first worker's
    fresh interpreter (torch's and the model's imports: 6.8 s of real MiniLM), a 3-minute budget
    kept room for two such starts that now fork in 0.5 s, confirmed in one process for want of a
    second, and ended 45 s early. A forking runner prices a restart at what the first worker did
    past its imports (unpickling the payload, making its context), which a fork does at most."""
    from autotune.trial.runner import SubprocessRunner, pickle_spec

    spec = WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=FAST)  # fmt: skip
    forking = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "f.log", fork=True)
    plain = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "p.log")
    try:
        assert plain.start_s > plain.info["init_s"]  # the whole start: the imports too
        _wait_ready(tmp_path / "f-server")  # until then a restart is a fresh interpreter, priced so
        assert forking.start_s == pytest.approx(forking.info["init_s"])
        assert 0 < forking.start_s < forking._last_s  # the first start's whole seconds
        ready = tmp_path / "f-server" / "ready"
        ready.unlink()  # a server not ready forks nothing: a restart is a fresh interpreter again
        assert forking.start_s == forking._last_s
        ready.touch()
        forking.restart()
        assert type(forking._proc).__name__ == "_Forked"  # what it was priced as
        assert forking.run(dict(Config({"batch_size": 16}))).status == "ok"
    finally:
        forking.close()
        plain.close()


def _wait_ready(folder, timeout_s=120.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not (folder / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def test_a_script_without_a_main_guard_is_not_run_again_by_a_forked_worker(tmp_path):
    """multiprocessing's children import the parent's main script again: a user's script
    without ``if __name__ == "__main__"`` would run once more in every forked worker."""
    import os
    import subprocess
    import sys

    script = tmp_path / "tune.py"
    script.write_text(
        "import pathlib\n"
        "from autotune.config import Config\n"
        "from autotune.trial.measure import MeasureSettings\n"
        "from autotune.trial.runner import SubprocessRunner, pickle_spec\n"
        "from autotune.trial.spec import WorkerSpec\n"
        "from tests.models import MLP, classification_data\n"
        "print('script ran', flush=True)\n"
        "spec = WorkerSpec(model=MLP(), dataset=classification_data(32), metric=None, device='cpu',\n"
        "                  baseline=dict(Config({'batch_size': 8})), val_indices=list(range(8)),\n"
        "                  measure=MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1))\n"
        f"runner = SubprocessRunner(pickle_spec(spec), 120.0, pathlib.Path({str(tmp_path)!r}) / 'w.log', fork=True)\n"
        "import time\n"
        "while not (pathlib.Path(runner._server.ready)).exists(): time.sleep(0.2)  # a fork, not a fresh start\n"
        "runner.restart()\n"
        "print(runner.run(dict(Config({'batch_size': 16}))).status, flush=True)\n"
        "runner.close()\n"
        "import multiprocessing\n"
        "multiprocessing.set_start_method('spawn')  # still the user's to choose\n"
        "print('ok', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    output = done.stdout + (tmp_path / "w.log").read_text()
    assert output.count("script ran") == 1 and done.stdout.strip().endswith("ok"), output[-2000:]
