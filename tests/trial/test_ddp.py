"""Distributed training trials (``world_size`` > 1): ranks under torchrun, gloo on the CPU, the
loss curve of one process at the same global effective batch, ``no_sync`` counted in
all-reduces, faults that leave nothing behind, and the user's own script on two "nodes"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from torch import nn

from autotune.config import Config
from autotune.errors import ConfigError
from autotune.trial.inprocess import InProcessRunner
from autotune.trial.measure import MeasureSettings
from autotune.trial.spec import WorkerSpec
from tests.models import SmallCNN
from tests.trial.test_training import _cross_entropy, _digits


class KilledOnRank1(SmallCNN):
    """Rank 1 of a distributed run kills itself in its third forward pass."""

    calls = 0

    def forward(self, x):
        KilledOnRank1.calls += 1
        if os.environ.get("RANK") == "1" and KilledOnRank1.calls == 3:
            os.kill(os.getpid(), 9)
        return super().forward(x)


class HangsOnRank1(SmallCNN):
    """Rank 1 of a distributed run never ends its third forward pass."""

    calls = 0

    def forward(self, x):
        HangsOnRank1.calls += 1
        if os.environ.get("RANK") == "1" and HangsOnRank1.calls == 3:
            time.sleep(3600)
        return super().forward(x)


def _runner(model=None, optimizer=(torch.optim.SGD, {"lr": 0.05})):
    spec = WorkerSpec(
        model=model if model is not None else SmallCNN(),
        dataset=_digits(),
        metric=None,
        device="cpu",
        baseline=dict(Config({"batch_size": 16})),
        val_indices=list(range(32)),
        measure=MeasureSettings(n_windows=2, window_s=0.1, warmup_batches=1, n_remeasure=0),
        loss_fn=_cross_entropy,
        mode="train",
        optimizer=optimizer,
        effective_batch_size=32,
        n_train_steps=8,
    )
    return InProcessRunner(spec)


def _ranks_left() -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if "autotune.trial.ddp" in line or "torch.distributed.run" in line:
            found.append(line)
    return found


def _settled(deadline_s: float = 20.0) -> list:
    end = time.monotonic() + deadline_s
    while _ranks_left() and time.monotonic() < end:
        time.sleep(0.2)
    return _ranks_left()


def test_two_ranks_train_the_loss_curve_of_one_process_and_no_sync_saves_the_all_reduces():
    runner = _runner()
    base = runner.run(dict(Config({"batch_size": 16})), timeout=300)
    assert base.status == "ok"
    runs = {
        "no accumulation": {"batch_size": 16},
        "accumulation, no_sync": {"batch_size": 8},
        "accumulation, every step": {"batch_size": 8, "ddp_no_sync": False},
    }
    got = {}
    for name, values in runs.items():
        result = runner.run(dict(Config({**values, "world_size": 2})), timeout=300)
        assert result.status == "ok", (name, result.reason)
        got[name] = result.metrics
        # The same 32 samples a step (16 or 2 x 8 per rank, 2 ranks), the same initial weights.
        assert result.metrics["effective_batch_size"] == 32 and result.metrics["world_size"] == 2
        assert abs(result.metrics["loss_rel_change"]) < 1e-4, (name, result.metrics["loss_final"])
        assert result.metrics["loss_first"] == pytest.approx(base.metrics["loss_first"], rel=1e-4)
    buckets = got["no accumulation"]["allreduces_per_step"]
    assert buckets >= 1 and got["accumulation, no_sync"]["accumulation_steps"] == 2
    assert got["accumulation, no_sync"]["allreduces_per_step"] == buckets  # only the step's last micro-batch
    assert got["accumulation, every step"]["allreduces_per_step"] == 2 * buckets
    assert not _settled()


def test_ddps_own_knobs_and_zero1_train_the_same_curve():
    """Every DDP knob off its default at once, the optimizer's state sharded (ZeRO-1, with
    momentum so there is state to shard): the same losses as one process."""
    runner = _runner(optimizer=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}))
    assert runner.run(dict(Config({"batch_size": 16})), timeout=300).status == "ok"
    knobs = {"ddp_zero1": True, "ddp_static_graph": True, "ddp_bucket_view": True, "ddp_bucket_cap_mb": 5,
             "ddp_broadcast_buffers": False}  # fmt: skip
    result = runner.run(dict(Config({"batch_size": 16, "world_size": 2, **knobs})), timeout=300)
    assert result.status == "ok", result.reason
    assert abs(result.metrics["loss_rel_change"]) < 1e-4
    assert not _settled()


def test_a_rank_killed_mid_step_ends_the_trial_and_leaves_no_process(tmp_path, monkeypatch):
    import tempfile

    # The system's temporary folder, here and in the ranks' launcher: nothing is left in it.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runner = _runner(KilledOnRank1())
    assert runner.run(dict(Config({"batch_size": 16})), timeout=300).status == "ok"
    started = time.monotonic()
    result = runner.run(dict(Config({"batch_size": 16, "world_size": 2})), timeout=120)
    assert result.status == "error" and result.kind == "crash", result.reason
    assert "rank" in result.reason and time.monotonic() - started < 120
    assert not _settled()
    assert runner.run(dict(Config({"batch_size": 8})), timeout=300).status == "ok"  # the search goes on
    assert not list(tmp_path.iterdir())  # torchrun's logs went with the trial's own folder


@pytest.mark.slow  # waits out a trial limit
def test_a_rank_hung_in_a_collective_is_stopped_at_the_trials_limit():
    runner = _runner(HangsOnRank1())
    assert runner.run(dict(Config({"batch_size": 16})), timeout=300).status == "ok"
    started = time.monotonic()
    result = runner.run(dict(Config({"batch_size": 16, "world_size": 2})), timeout=25)
    assert result.status == "timeout", result.reason
    assert time.monotonic() - started < 25 + 30
    assert not _settled()


@pytest.mark.slow  # a compile in each rank
@pytest.mark.parametrize("dynamic", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_compiled_configuration_compiles_the_ddp_wrapper_and_keeps_the_curve(dynamic):
    runner = _runner()
    assert runner.run(dict(Config({"batch_size": 16})), timeout=300).status == "ok"
    config = {"batch_size": 16, "world_size": 2, "compile_mode": "default", "compile_dynamic": dynamic}
    result = runner.run(dict(Config(config)), timeout=600)
    assert result.status == "ok", result.reason
    assert abs(result.metrics["loss_rel_change"]) < 1e-3 and result.metrics["compile_s"] > 0
    assert not _settled()


class WithUnusedHead(SmallCNN):
    """A second head the forward never calls: DDP needs find_unused_parameters for it."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(4, 4)


def test_unused_parameters_are_detected_not_guessed_and_the_model_is_left_as_it_was():
    from autotune.trial.ddp_steps import unused_parameters

    x, y = torch.randn(4, 1, 8, 8), torch.arange(4)
    for model, unused in ((SmallCNN(), False), (WithUnusedHead(), True)):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert unused_parameters(model, (x, y), _cross_entropy) is unused
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert all(p.grad is None for p in model.parameters())


def test_a_model_with_unused_parameters_trains_in_two_ranks_with_them_found():
    runner = _runner(WithUnusedHead())
    assert runner.run(dict(Config({"batch_size": 16})), timeout=300).status == "ok"
    result = runner.run(dict(Config({"batch_size": 16, "world_size": 2})), timeout=300)
    assert result.status == "ok", result.reason
    assert result.metrics["find_unused_parameters"] is True and abs(result.metrics["loss_rel_change"]) < 1e-4


def test_training_outside_torchrun_says_how_to_launch_it():
    import autotune

    data = [(torch.randn(8), torch.tensor(i % 2)) for i in range(64)]
    with pytest.raises(ConfigError, match=r"torchrun --standalone --nproc-per-node=2"):
        autotune.training(nn.Linear(8, 2), (torch.optim.SGD, {"lr": 0.1}), data, {"batch_size": 8, "world_size": 2},
                          device="cpu")  # fmt: skip


USER_SCRIPT = """
import json, sys, torch
import torch.distributed as dist
import autotune

x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
data = [(x[i], (x[i, 0] > 0).long()) for i in range(256)]
torch.manual_seed(0)
config = {"batch_size": 8, "world_size": 2, "ddp_bucket_cap_mb": 5}
t = autotune.training(torch.nn.Linear(8, 2), (torch.optim.SGD, {"lr": 0.5}), data, config, device="cpu",
                      effective_batch_size=32)
losses = []
for epoch in range(3):
    t.sampler.set_epoch(epoch)
    batches = iter(t.loader)
    for _ in range(len(t.loader) // t.accumulation_steps):
        losses.append(t.step(batches, lambda out, b: torch.nn.functional.cross_entropy(out, b[1])).item())
weights = [p.detach().clone() for p in t.model.parameters()]
rank = dist.get_rank()
print(json.dumps({"rank": rank, "world": dist.get_world_size(), "first": losses[0], "last": losses[-1],
                  "steps": len(losses), "weights": weights[0].flatten()[:4].tolist()}), flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_users_script_trains_on_two_nodes_meeting_at_a_c10d_rendezvous(tmp_path):
    """Two torchrun agents (two "machines" of one process each) meet at a local c10d endpoint, as
    best_config.json's multi-machine command line says, and run the user's own loop."""
    from autotune.trial.ddp import torchrun_command

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    command = torchrun_command(1, [str(script)], nnodes=2, endpoint=endpoint)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env, "cwd": tmp_path}
    agents = [subprocess.Popen(command, **pipes) for _ in range(2)]
    outputs = [a.communicate(timeout=240) for a in agents]
    assert all(a.returncode == 0 for a in agents), [o[1][-2000:] for o in outputs]
    import json

    ranks = sorted((json.loads(line) for o in outputs for line in o[0].splitlines() if line.startswith("{")),
                   key=lambda r: r["rank"])  # fmt: skip
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP kept the replicas equal
    assert ranks[0]["steps"] == 3 * (256 // 32) and ranks[0]["last"] < ranks[0]["first"]
    assert not _settled()
    assert sys.executable  # the agents ran this interpreter
