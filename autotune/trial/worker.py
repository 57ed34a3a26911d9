"""What runs inside a trial worker: set up once, then build, measure and guard configurations.

The parent (:mod:`autotune.trial.runner`) starts ``python -m autotune.trial.worker READ_FD WRITE_FD``
and talks to it over two pipes with pickled messages::

    parent -> ("init", spec, checked)   worker -> ("ready", info) | ("fail", kind, message)
                                        (checked: False, or what the first worker learned of the baseline)
    parent -> ("trial", config_dict)    worker -> ("phase", name) ..., ("result", TrialResult)
    parent -> ("call", name, *args)     worker -> ("result", dict)   (name: rounds, held_out, export, diagnose, profile)
    parent -> ("stop",)

The same context (:mod:`autotune.trial.inference`, :mod:`autotune.trial.training`) also runs in-process when ``isolation="inprocess"``.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import torch

from autotune.errors import InputError
from autotune.trial.faults import one_line
from autotune.trial.parent import watch_parent

__all__ = ["make_context", "serve", "watch_parent"]  # watch_parent: from autotune.trial.parent


def make_context(spec: Any, checked: bool | dict[str, Any] = False) -> Any:
    """The worker state for the spec's mode: :class:`autotune.trial.inference.TrialContext` or, in training mode,
    :class:`autotune.trial.training.TrainContext`; ``checked``: a later worker of the run, which
    makes the baseline's reference only when something reads it (a dict: what the first worker
    learned of the baseline, :meth:`~autotune.trial.inference.TrialContext.known`)."""
    if spec.mode == "train":
        from autotune.trial.training import TrainContext

        return TrainContext(spec)
    from autotune.trial.inference import TrialContext

    return TrialContext(spec, checked=checked)


def serve(conn: Any) -> None:
    """The worker's loop over one connection."""
    import io
    import pickle

    from autotune.trial.usercode import by_value_in_children

    message = conn.recv()
    began = time.perf_counter()  # past the imports: what a worker forked from the run's server pays, at most
    by_value_in_children()  # a DataLoader started here with spawn or forkserver gets the user's classes
    try:
        spec = torch.load(io.BytesIO(message[1]), weights_only=False, pickle_module=pickle)
        ctx = make_context(spec, checked=message[2] if len(message) > 2 else False)
    except InputError as exc:
        conn.send(("fail", "input", str(exc)))
        return
    except Exception as exc:
        traceback.print_exc()  # into the worker's log; the message stays one line
        conn.send(("fail", "error", one_line(exc)))
        return
    _freeze_heap()
    conn.send(("ready", {**ctx.info, "init_s": time.perf_counter() - began}))
    from autotune.trial.phase import listen

    listen(lambda phase: conn.send(("phase", phase)))  # read by the runner while it waits
    while True:
        message = conn.recv()
        if message[0] == "trial":
            conn.send(("result", ctx.run_trial(*message[1:])))
        elif message[0] == "call" and message[1] in ("rounds", "held_out", "export", "diagnose", "profile"):
            try:
                conn.send(("result", getattr(ctx, message[1])(*message[2:])))
            except Exception as exc:
                conn.send(("result", {"error": one_line(exc)}))
        else:
            return


def _freeze_heap() -> None:
    """Leave what the worker holds once it is set up (torch and the user's modules, the model,
    the samples) out of Python's later full garbage collections (``gc.freeze``), after one
    collection of what the setup left behind.

    A full collection walks every object the process holds: in a worker of real MiniLM behind
    its tokenizer, about 500,000 objects and 0.2-0.5 s, and each trial's and each round's memory
    account starts with one (:func:`autotune.trial.memory.memory_mark`): 6 s of a 137-s run of
    16 trials, 1.2 s of its confirmation. A user's pass over the tuned loader runs frozen the same
    way (:func:`autotune.samples.collector_frozen`), so a trial's windows now time the loop the
    user runs. What a trial builds is collected as before."""
    import gc

    if gc.isenabled():
        gc.collect()
        gc.freeze()


def forked_main(inbox: Any, outbox: Any, log_path: str, env: dict[str, str], run_pid: int) -> None:
    """A worker forked from the run's fork server (:mod:`autotune.trial.forked`): in a session
    of its own, its output in ``log_path``, ``env`` over the server's environment, ending once
    the run's process ``run_pid`` is gone (not its parent, the server, which ends only after its
    children: each holds the pipe it watches)."""
    import multiprocessing.context
    import os

    # Started by the fork server, this process took its start method as its own default: a
    # DataLoader's workers here start as in a fresh worker or the user's process, by the
    # platform's default.
    multiprocessing.context._default_context._actual_context = None
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(env)
    watch_parent(run_pid, alive=True)
    _serve_pipes(inbox, outbox)


def _serve_pipes(inbox: Any, outbox: Any) -> None:
    """:func:`serve` on a receiving and a sending connection, until the parent goes away."""

    class _Duplex:
        recv = inbox.recv
        send = outbox.send

    try:
        serve(_Duplex())
    except EOFError:  # the parent went away
        pass


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection

    watch_parent(int(argv[3]) if len(argv) > 3 else None)
    read_fd, write_fd = int(argv[1]), int(argv[2])
    _serve_pipes(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


if __name__ == "__main__":
    main(sys.argv)
