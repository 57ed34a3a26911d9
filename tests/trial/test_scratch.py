"""A run leaves nothing in the temporary folder: its workers end killed, and each had kept its
candidates' exported files (an ONNX graph, an OpenVINO IR: 368 MB for one real MiniLM worker)
in a folder of its own that nothing removed."""

import tempfile

import pytest
import torch

from autotune.config import Config
from autotune.trial.measure import MeasureSettings
from autotune.trial.runner import SubprocessRunner, pickle_spec
from autotune.trial.spec import WorkerSpec
from tests.models import MLP, classification_data
from tests.trial.test_worker_start import _wait_ready


def test_a_killed_workers_candidate_files_go_with_it_and_the_run_leaves_no_temporary_files(tmp_path, monkeypatch):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the workers' temporary folder, and this process's:
    monkeypatch.setattr(tempfile, "tempdir", None)
    spec = WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
                      measure=MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1, n_remeasure=0))  # fmt: skip
    config = dict(Config({"batch_size": 8, "runtime": "onnxruntime"}))
    runner = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "w.log", fork=True)
    try:
        root = runner._scratch.path
        assert root.parent == temp
        first = runner._proc.pid
        assert runner.run(config).status == "ok"
        assert list((root / str(first)).rglob("model.onnx")), "the candidate's graph is in its worker's folder"
        _wait_ready(tmp_path / "w-server")
        runner.restart()
        assert not (root / str(first)).exists()  # killed, and its files removed
        assert type(runner._proc).__name__ == "_Forked"  # a fork writes there too
        second = runner._proc.pid
        assert runner.run(config).status == "ok" and list((root / str(second)).rglob("model.onnx"))
    finally:
        runner.close()
    assert not root.exists()
    assert not list(temp.glob("autotune-*"))  # only what torch and multiprocessing keep there


class _FailsToStartWhen(MLP):
    """A model whose later copies fail to load while ``marker`` exists: a worker that fails to start."""

    def __init__(self, marker):
        super().__init__()
        self.marker = str(marker)

    def __setstate__(self, state):
        import os

        super().__setstate__(state)
        if os.path.exists(self.marker):
            raise RuntimeError("this copy cannot load")


def test_a_worker_that_fails_to_start_leaves_the_runs_scratch_folder_to_the_next(tmp_path, monkeypatch):
    """A start that fails stops the runner's workers, but the runner goes on (a spare that did not
    start, a restart the deadline cut off): the next worker's files still go where they are removed."""
    import pytest

    from autotune.errors import TrialError

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    marker = tmp_path / "fail"
    spec = WorkerSpec(model=_FailsToStartWhen(marker), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
                      measure=MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1, n_remeasure=0))  # fmt: skip
    config = dict(Config({"batch_size": 8, "runtime": "onnxruntime"}))
    runner = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "w.log")
    try:
        root = runner._scratch.path
        marker.touch()
        with pytest.raises(TrialError, match="failed to start"):
            runner.restart()
        marker.unlink()
        assert root.is_dir()
        assert runner.run(config).status == "ok"  # a new worker, its files under the run's folder
        assert list((root / str(runner._proc.pid)).rglob("model.onnx"))
    finally:
        runner.close()
    assert not root.exists() and not list(temp.glob("autotune-*"))


def test_ctrl_c_during_a_trial_then_close_stops_the_busy_worker_and_removes_its_files(tmp_path):
    """Ctrl-C lands while the parent waits on a trial (a notebook's interrupt): the worker is busy
    and will not read "stop". Closing the runner kills it, where it used to be left running."""
    import signal

    import psutil
    import pytest

    from tests.models import HangAt

    spec = WorkerSpec(model=HangAt(16), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
                      measure=MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1, n_remeasure=0))  # fmt: skip
    runner = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "w.log")
    worker, root = runner._proc.pid, runner._scratch.path

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 3.0)
        with pytest.raises(KeyboardInterrupt):
            runner.run(dict(Config({"batch_size": 16})))  # hangs in the worker
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        runner.close()
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert not root.exists()


def test_a_later_worker_reads_the_baseline_reference_the_first_one_stored(tmp_path):
    """The first worker's reference (the baseline's outputs and metric on the validation
    samples) is stored in the run's scratch folder, and a later worker reads it instead of
    running the baseline over the samples again (an export after a selection ran the plain real
    MiniLM over them again: 1.7 s). A file it cannot read, it makes again and replaces."""
    spec = WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
                      measure=MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1, n_remeasure=0))  # fmt: skip
    base = dict(Config({"batch_size": 8}))
    runner = SubprocessRunner(pickle_spec(spec), 120.0, tmp_path / "w.log", fork=True)
    try:
        assert runner.run(base).status == "ok"
        stored = runner._scratch.path / "reference-cpu.pt"
        held = torch.load(stored, weights_only=False)
        assert held["metric"] == pytest.approx(1.0) and len(held["outputs"]) == 16
        held["metric"] += 0.5  # a baseline no trial matches: only the stored file says so
        torch.save(held, stored)
        runner.restart()
        assert runner.run(base).metrics["metric_drop"] == pytest.approx(0.5, abs=1e-3)
        stored.write_bytes(b"not a reference")
        runner.restart()
        again = runner.run(base)
        assert again.metrics["metric_drop"] == pytest.approx(0.0, abs=1e-6), again
        assert torch.load(stored, weights_only=False)["metric"] == pytest.approx(1.0)
    finally:
        runner.close()


def test_a_reference_that_cannot_be_stored_leaves_the_run_going(tmp_path):
    """Storing the reference is an optimization: a write that fails (a full disk, say) leaves
    no partial file and the trial measured, and the next worker makes its own."""
    from pathlib import Path

    from autotune.trial.guard import Reference

    reference = Reference(samples=[], chunk=8, outputs=torch.zeros(4, 2), metric=1.0)
    missing = tmp_path / "gone" / "reference-cpu.pt"  # its folder does not exist: the write fails
    assert reference.save(missing) is False
    assert not list(tmp_path.rglob("*.part")) and Reference.load(missing, []) is None
    assert reference.save(Path(tmp_path / "reference-cpu.pt")) is True
    assert Reference.load(tmp_path / "reference-cpu.pt", []).metric == 1.0
