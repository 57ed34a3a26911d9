"""Many workers on one study, as real processes on a real database: PostgreSQL (skipped when no
server can be reached) and the default SQLite file of one output directory.

The model sleeps a fixed time per batch, so throughput grows with the batch size whatever the
load of the machine: the best configuration is unambiguous even with four workers on two cores.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import optuna
import pytest
from optuna.trial import TrialState

import autotune
from autotune.cli import main
from autotune.search.status import study_status
from autotune.search.storage import open_storage, redact

CFG = """
import os, time, torch
from torch import nn

class Sleepy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        mark = os.environ.get("HANG_MARK")
        if mark and x.shape[0] == int(os.environ["HANG_AT"]) and not os.path.exists(mark):
            with open(mark, "w") as f:  # the first worker to get here hangs until it is killed
                f.write(str(os.getpid()))
            time.sleep(3600)
        time.sleep(0.004)
        return self.lin(x)

model = Sleepy()
dataset = [torch.randn(8) for _ in range(256)]
space = {"base": None, "batch_size": BATCH_SIZES}
options = {
    "measure": {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
    "baseline_batch_size": 8,
    "n_val": 32,
    "n_verify_pairs": 1,
    "n_finalists": 0,  # the winner is the best stored measurement, as a sequential run would choose it
    "device": "cpu",
    "isolation": "inprocess",
    "export": (),
}
"""


def _postgres_url() -> str:
    url = os.environ.get("AUTOTUNE_TEST_POSTGRES") or "postgresql://autotune@127.0.0.1:54329/autotune"
    try:
        import psycopg
    except ImportError:
        pytest.skip('psycopg is not installed (pip install "torch-autotune[postgres]")')
    try:
        psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=3).close()
    except Exception as exc:
        pytest.skip(f"no PostgreSQL server at {url}; set AUTOTUNE_TEST_POSTGRES or run through .ci/services ({exc})")
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def shared(request, tmp_path):
    """How the workers find the study: (storage URL, study name, flags of worker ``i``)."""
    if request.param == "sqlite":  # one file on this machine: every worker names it, sharing one out dir
        out = tmp_path / "out"
        url = f"sqlite:///{out / 'study.db'}"
        yield url, "autotune", lambda i: ["--out", str(out), "--storage", url]
        return
    url = _postgres_url()
    name = f"test-scale-{uuid.uuid4().hex[:12]}"
    yield url, name, lambda i: ["--out", str(tmp_path / f"out{i}"), "--storage", url, "--study", name]
    storage = optuna.storages.RDBStorage(url)
    for study in storage.get_all_studies():
        if study.study_name == name or study.user_attrs.get("family") == name:
            optuna.delete_study(study_name=study.study_name, storage=storage)


def _cfg(tmp_path, batch_sizes) -> str:
    path = tmp_path / "cfg.py"
    path.write_text(textwrap.dedent(CFG).replace("BATCH_SIZES", repr(batch_sizes)))
    return str(path)


def _start(cfg, flags, n_trials, env=None):
    cmd = [sys.executable, "-m", "autotune", "run", cfg, "--join", "--quiet", "--trials", str(n_trials), *flags]
    # One torch thread each: four workers on a small machine would otherwise spin on each other's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _trials(url, name):
    return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)


def _measured(trials):
    return [t for t in trials if t.user_attrs.get("ran") and t.user_attrs.get("repeat_of") is None]


def test_two_workers_share_one_study_with_the_budget_exact(shared, tmp_path):
    """The CI version of the four-worker test below: two processes (each imports torch once, the
    cost that dominates on two cores), the same promises."""
    url, name, flags = shared
    cfg = _cfg(tmp_path, [1, 2, 4, 8, 16, 32, 64])
    procs = [_start(cfg, [*flags(i), "--no-profile"], n_trials=4) for i in range(2)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)

    trials = _trials(url, name)
    measured = _measured(trials)
    assert len(measured) == 4, "the budget counts every worker's trials, exactly"
    keys = [t.user_attrs["key"] for t in measured]
    assert len(set(keys)) == len(keys), "a configuration was measured twice"
    assert sum(t.user_attrs["baseline"] for t in measured) == 1
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # A twin both workers queued at once is withdrawn while still waiting: no worker ever asked for it.
    asked = [t for t in trials if not t.user_attrs.get("withdrawn")]
    assert all("worker" in t.user_attrs for t in asked), "every trial a worker asked for names its worker"
    assert len({t.user_attrs["worker"] for t in asked}) == 2, "both workers took part in the study"
    ok = [t for t in measured if t.user_attrs["status"] == "ok"]
    fastest = max(ok, key=lambda t: t.user_attrs["samples_per_s"]).user_attrs["config"]
    for i in range(2):
        best = json.loads((tmp_path / ("out" if "sqlite" in url else f"out{i}") / "best_config.json").read_text())
        assert best["config"] == fastest and best["n_trials"] == len(trials)


@pytest.mark.slow  # CI runs the two-worker version above
def test_four_workers_share_one_study(shared, tmp_path):
    url, name, flags = shared
    cfg = _cfg(tmp_path, [1, 2, 4, 8, 16, 32, 64])
    procs = [_start(cfg, flags(i), n_trials=6) for i in range(4)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outputs)

    trials = _trials(url, name)
    measured = _measured(trials)
    assert len(measured) == 6, "the budget counts every worker's trials, exactly"
    keys = [t.user_attrs["key"] for t in measured]
    assert len(set(keys)) == len(keys), "a configuration was measured twice"
    assert sum(t.user_attrs["baseline"] for t in measured) == 1
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len({t.user_attrs["worker"] for t in measured}) >= 2, "the trials were shared out"
    # Every worker names the same winner: the fastest of the stored measurements, which for
    # this model is the largest batch size measured.
    ok = [t for t in measured if t.user_attrs["status"] == "ok"]
    fastest = max(ok, key=lambda t: t.user_attrs["samples_per_s"]).user_attrs["config"]
    assert fastest["batch_size"] == max(t.user_attrs["config"]["batch_size"] for t in ok)
    for i in range(4):
        best = json.loads((tmp_path / ("out" if "sqlite" in url else f"out{i}") / "best_config.json").read_text())
        assert best["config"] == fastest and best["n_trials"] == len(trials)

    (group,) = study_status(url, name)["groups"]
    assert group["n_measured"] == 6 and group["n_requested"] == 6 and group["best"]["config"] == fastest
    assert sum(w["n_measured"] for w in group["workers"].values()) == 6 and not group["running"]


def test_killed_worker_trial_fails_by_heartbeat_and_is_retried(shared, tmp_path):
    url, name, flags = shared
    cfg = _cfg(tmp_path, [8, 4])
    mark = tmp_path / "hanging"
    env = {"HANG_AT": "4", "HANG_MARK": str(mark)}
    # Beat every second; a silence of 5 s means death (the default, minutes, would make a slow test).
    procs = [_start(cfg, [*flags(i), "--heartbeat", "1", "--grace", "5"], n_trials=2, env=env) for i in range(2)]
    deadline = time.monotonic() + 120
    while not mark.exists() or not mark.read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no worker reached the hang"
        time.sleep(0.1)
    pid = int(mark.read_text())
    (victim,) = [p for p in procs if p.pid == pid]
    (survivor,) = [p for p in procs if p.pid != pid]
    os.kill(pid, signal.SIGKILL)  # mid-trial: it is sleeping inside the model's forward
    victim.communicate(timeout=30)
    output = survivor.communicate(timeout=120)[0]
    assert victim.returncode == -signal.SIGKILL and survivor.returncode == 0, output

    trials = _trials(url, name)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # On this host its dead process is recognised at once (status interrupted); elsewhere the
    # heartbeat's silence tells (no status). Its skipped claims are FAIL too, with status skipped.
    dump = [(t.number, t.state.name, t.user_attrs, t.system_attrs) for t in trials]
    deads = [
        t
        for t in trials
        if t.user_attrs.get("worker", "").split(":")[1:2] == [str(pid)]
        and t.state == TrialState.FAIL
        and t.user_attrs.get("status") in (None, "interrupted")
    ]
    assert deads and all(t.user_attrs["config"]["batch_size"] == 4 for t in deads), dump
    # Its configuration is measured again, once, by the survivor. (Which of its failed records
    # the retry names depends on who saw it die first: its process gone, or its heartbeat silent.)
    (retry,) = [t for t in trials if t.user_attrs.get("retry_of") in {d.number for d in deads}]
    dead = next(d for d in deads if d.number == retry.user_attrs["retry_of"])
    assert retry.system_attrs["failed_trial"] == dead.number and retry.number > dead.number, dump
    # Measured (batch 4 may run under 75% of the baseline's batch 8 and stop early: still measured).
    assert retry.user_attrs["status"] in ("ok", "stopped") and retry.user_attrs["ran"], dump
    assert retry.user_attrs["key"] == dead.user_attrs["key"] and retry.user_attrs["worker"] != dead.user_attrs["worker"]
    assert len(_measured(trials)) == 2


def test_devices_start_one_pinned_worker_process_each(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = _cfg(tmp_path, [1, 2, 4, 8, 16, 32, 64])
    out = tmp_path / "out"
    argv = ["run", cfg, "--devices", "cpu,cpu", "--isolation", "subprocess", "--trials", "5", "--out", str(out)]
    with pytest.warns(UserWarning, match="smoke-test"):
        assert main([*argv, "--quiet"]) == 0
    trials = _trials(f"sqlite:///{out / 'study.db'}", "autotune")
    measured = _measured(trials)
    assert len(measured) == 5 and len({t.user_attrs["key"] for t in measured}) == 5
    workers = {t.user_attrs["worker"] for t in measured}
    assert {w.rsplit(":", 1)[1] for w in workers} == {"cpu0", "cpu1"}, "both worker processes measured"
    assert all(w.split(":")[1] == str(os.getpid()) for w in workers)
    assert (out / "logs" / "worker-0.log").exists() and (out / "logs" / "worker-1.log").exists()
    capsys.readouterr()
    assert main(["status", str(out), "--json"]) == 0
    (group,) = json.loads(capsys.readouterr().out)["groups"]
    assert group["n_measured"] == 5 and set(group["workers"]) >= workers


def test_device_lists_that_cannot_work_are_refused():
    with pytest.raises(autotune.ConfigError, match="mixes CPU and GPUs"):
        autotune.optimize(None, [], devices=["cpu", 0])
    with pytest.raises(autotune.ConfigError, match="GPU indices"):
        autotune.optimize(None, [], devices="gpu0")
    with pytest.raises(autotune.ConfigError, match="one worker process each"):
        autotune.optimize(None, [], devices="cpu,cpu", isolation="inprocess")
    with pytest.raises(autotune.ConfigError, match="must be a list"):
        autotune.optimize(None, [], devices={0, 1})


def test_storage_errors_say_where_and_how_to_fix():
    with pytest.raises(autotune.ConfigError, match=r"127\.0\.0\.1:1 .*Connection refused|127\.0\.0\.1:1 .*connect"):
        open_storage("postgresql://tuner:secret@127.0.0.1:1/studies")
    with pytest.raises(autotune.ConfigError, match="postgresql://, not postgres://"):
        open_storage("postgres://tuner@db/studies")
    with pytest.raises(autotune.ConfigError, match=r"pip install|driver"):
        open_storage("postgresql+pg8000://tuner@db/studies")
    assert redact("postgresql://tuner:secret@db/studies") == "postgresql://tuner:***@db/studies"
    assert redact("postgresql://tuner:pa/ss@db/studies") == "postgresql://tuner:***@db/studies"
    assert redact("postgresql://db/studies?user=t&password=s3") == "postgresql://db/studies?user=t&password=***"
    with pytest.raises(autotune.ConfigError, match="grace_period_s"):
        open_storage("sqlite://", heartbeat_interval_s=10, grace_period_s=5)


@pytest.mark.gpu
def test_gpu_devices_each_see_only_their_gpu(tmp_path, monkeypatch):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs to tell each worker's apart; this machine has {torch.cuda.device_count()}")
    n_gpus = 2
    seen = tmp_path / "seen"
    seen.mkdir()
    cfg = tmp_path / "cfg.py"
    cfg.write_text(
        textwrap.dedent(
            f"""
            import os, torch
            from torch import nn

            class Probe(nn.Linear):
                def forward(self, x):
                    path = os.path.join({str(seen)!r}, str(os.getpid()))
                    if not os.path.exists(path):  # what this worker process sees
                        with open(path, "w") as f:
                            f.write(f"{{os.environ.get('CUDA_VISIBLE_DEVICES')}} {{torch.cuda.device_count()}} {{x.device}}")
                    return super().forward(x)

            model = Probe(8, 2)
            dataset = [torch.randn(8) for _ in range(256)]
            space = {{"base": None, "batch_size": [8, 16, 32, 64]}}
            options = {{"measure": {{"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}}, "baseline_batch_size": 8,
                       "n_val": 32, "n_verify_pairs": 1, "export": ()}}
            """
        )
    )
    out = tmp_path / "out"
    devices = ",".join(str(i) for i in range(n_gpus))
    assert main(["run", str(cfg), "--devices", devices, "--trials", "4", "--out", str(out), "--quiet"]) == 0
    views = sorted(p.read_text().split() for p in seen.iterdir())
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v] or [str(i) for i in range(n_gpus)]
    assert {v[0] for v in views} == set(visible[:n_gpus]), views  # one GPU each, pinned
    assert all(v[1] == "1" and v[2] == "cuda:0" for v in views), views
    trials = _trials(f"sqlite:///{out / 'study.db'}", "autotune")
    assert {t.user_attrs["worker"].rsplit(":", 1)[1] for t in _measured(trials)} <= {f"gpu{i}" for i in range(n_gpus)}
    assert all(torch.cuda.get_device_name(0) in t.user_attrs["hardware"] for t in trials if "hardware" in t.user_attrs)
