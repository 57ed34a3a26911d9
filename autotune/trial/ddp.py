"""A distributed training trial: the step in ``world_size`` ranks started by torchrun.

The trial's worker writes its spec and the configuration to a folder and starts PyTorch's own
launcher (``python -m torch.distributed.run``, torchrun's elastic agent) on this module, one
rank per GPU or per share of the CPU's cores. Each rank:

- joins the process group (``nccl`` on GPUs, ``gloo`` on CPUs), pinned to its GPU or its cores;
- builds the configuration's training setup from the same initial weights, wraps the model in
  ``DistributedDataParallel`` with the configuration's DDP knobs (``find_unused_parameters``
  detected, not guessed), shards the optimizer's state with ZeRO-1 where asked, and compiles the
  wrapped model where the configuration compiles (``torch.compile(DDP(model))``);
- reads its slice of every global batch (:class:`RankSlice`): the global effective batch
  (micro-batch x accumulation x world size) holds the same samples, in the same steps, as the
  single-process baseline's, so the loss curves compare step for step;
- trains the guard's steps (the loss of each step averaged over the ranks), then times whole
  steps in windows that every rank ends together.

Rank 0 writes ``result.json``; a rank that fails writes its error. A rank that dies, hangs past
the collective timeout or runs out of memory ends the trial: the agent stops the others, the
worker reads why, and nothing is left (each rank ends with its agent, the agent with the worker).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from autotune.config import values_of
from autotune.errors import TrialError
from autotune.trial.ddp_steps import RankSlice

__all__ = ["RankSlice", "launch", "torchrun_command"]

# Seconds a collective may wait for a rank before the process group gives up (a hung rank).
COLLECTIVE_TIMEOUT_S = 120.0


def torchrun_command(
    world: int, entry: list[str], *, nnodes: int = 1, endpoint: str | None = None, log_dir: Path | None = None
) -> list[str]:
    """The torchrun command line of ``world`` ranks per machine running ``entry`` (a module and
    its arguments): standalone on one machine, or ``nnodes`` machines meeting at ``endpoint``
    (``host:port`` of a c10d rendezvous); the agent's logs go to ``log_dir`` (torchrun's own
    default is a new ``torchelastic_*`` folder in the system's temporary folder, never removed).

    Example:
        >>> torchrun_command(2, ["train.py"])[1:]
        ['-m', 'torch.distributed.run', '--standalone', '--nnodes=1', '--nproc-per-node=2', '--max-restarts=0', 'train.py']
    """
    rendezvous = ["--standalone"] if endpoint is None else ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
    logs = [] if log_dir is None else [f"--log-dir={log_dir}"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nnodes={nnodes}",
            f"--nproc-per-node={world}", "--max-restarts=0", *logs, *entry]  # fmt: skip


def _threads_per_rank(world: int) -> int:
    from autotune.env import usable_cpus

    return max(1, usable_cpus() // world)


def launch(spec: Any, config: Mapping[str, Any], folder: Path, limit_s: float | None = None) -> dict[str, Any]:
    """Run ``config``'s distributed trial in its ``world_size`` ranks under torchrun; rank
    0's result. ``spec`` is a worker spec, or its pickle (:func:`~autotune.trial.spec.pickle_spec`)
    made once for many launches. Raises :class:`TrialError` with the failing rank's error
    (``crash`` when a rank died, ``timeout`` past ``limit_s``)."""
    from autotune.trial.spec import pickle_spec

    world = int(values_of(config).world_size)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.pt").write_bytes(spec if isinstance(spec, bytes) else pickle_spec(spec))
    (folder / "config.json").write_text(json.dumps(dict(config)))
    env = {**os.environ, "OMP_NUM_THREADS": str(_threads_per_rank(world)), "PYTHONUNBUFFERED": "1"}
    # The agent's logs stay in the trial's folder, which goes with the trial.
    command = torchrun_command(world, ["-m", "autotune.trial.ddp", str(folder)], log_dir=folder / "agent")
    with open(folder / "agent.log", "wb") as log:
        agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                 preexec_fn=_die_with_parent)  # fmt: skip
        try:
            code = agent.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _end(agent)
    result = folder / "result.json"
    if code == 0 and result.is_file():
        return json.loads(result.read_text())
    raise _failure(folder, world, code, limit_s)


def _end(agent: subprocess.Popen) -> None:
    """Stop the agent (it stops its ranks) and wait for it; kill its group if it lingers."""
    if agent.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGTERM)
        try:
            agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def _failure(folder: Path, world: int, code: int | None, limit_s: float | None) -> TrialError:
    """Why the ranks failed: the rank torchrun names as the root cause (killed by a signal: a
    ``crash``), else the error a rank wrote, else the agent's exit."""
    if code is None:
        return TrialError("timeout", f"the {world} ranks did not finish within {limit_s:g} s: stopped")
    log = (folder / "agent.log").read_text(errors="replace") if (folder / "agent.log").exists() else ""
    cause = log[log.find("Root Cause") :] if "Root Cause" in log else ""
    rank = re.search(r"rank\s*:\s*(\d+)", cause)
    exit_code = re.search(r"exitcode\s*:\s*(-?\d+)", cause)
    signal_line = re.search(r"traceback\s*:\s*(Signal \d+ \(\w+\))", cause)
    if rank and exit_code and int(exit_code.group(1)) < 0:
        how = signal_line.group(1) if signal_line else f"signal {-int(exit_code.group(1))}"
        return TrialError("crash", f"rank {rank.group(1)} of {world} died: {how}")
    errors = sorted(folder.glob("error-*.txt"))
    own = folder / f"error-{rank.group(1)}.txt" if rank else None
    found = own if own is not None and own.is_file() else (errors[0] if errors else None)
    if found is not None:
        kind, _, text = found.read_text().partition(" ")
        return TrialError(kind, f"rank {found.stem.split('-')[1]} of {world}: {text.strip()}")
    return TrialError("crash", f"the ranks failed (torchrun exit code {code}): {log.strip()[-300:]}")


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (elsewhere, nothing)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


# --- a rank ---------------------------------------------------------------------------------------


def rank_main(folder: Path) -> None:
    """One rank of a distributed trial (see the module's docstring)."""
    import pickle

    import torch.distributed as dist

    from autotune.trial.parent import watch_parent

    _die_with_parent(signal.SIGKILL)
    watch_parent()  # the agent gone: this rank and its loader workers end too
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    try:
        spec = torch.load(folder / "spec.pt", weights_only=False, pickle_module=pickle)
        config = json.loads((folder / "config.json").read_text())
        device = _pin(spec.device, local, world)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            from autotune.trial.ddp_steps import train_rank

            result = train_rank(spec, config, rank, world, device)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    except BaseException as exc:
        from autotune.trial.faults import classify

        _, kind, reason = classify(exc) if isinstance(exc, Exception) else ("error", "crash", repr(exc))
        (folder / f"error-{rank}.txt").write_text(f"{kind} {reason}")
        raise
    if rank == 0:
        tmp = folder / "result.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(folder / "result.json")


def _pin(device: str, local: int, world: int) -> str:
    """This rank's device: GPU ``local`` on CUDA; on a CPU, its share of the cores."""
    if device.startswith("cuda"):
        from autotune.env import use_device

        use_device(f"cuda:{local}")
        return f"cuda:{local}"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = max(1, len(cores) // world) if cores else _threads_per_rank(world)
    if len(cores) >= world:
        os.sched_setaffinity(0, cores[local * share : (local + 1) * share])
    torch.set_num_threads(share)
    return "cpu"


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
