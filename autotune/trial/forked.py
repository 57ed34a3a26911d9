"""How a trial worker process starts: a fresh interpreter (``python -m autotune.trial.worker``),
or, on a CPU run, forked from the run's fork server, a process that imported torch and the
user's modules (by reading the run's payload once) and has run nothing.

A fresh interpreter spends most of its start importing: torch, then the modules the payload
names (a Hugging Face model's took 2.4 s of a real MiniLM worker's 4-s start). A confirmation's
fresh worker paid that on every run's finish; a fork of the server unpickles the payload with
those modules in place (0.06 s) and is as fresh: nothing was measured, built or run in it. The
server never touches CUDA (it reads the payload onto the CPU), and it is used for CPU runs only.
Where it cannot start (no ``fork`` on this platform, too little free memory, a server of the
user's own already running), has not finished its imports, or a fork fails, the worker starts
as a fresh interpreter. The server is the run's: its runner stops it when it closes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ForkServer", "environ_with", "kill_worker", "launch", "stop_worker"]

# The variables naming, in the fork server's environment, the payload its preload reads, the
# file it writes once its imports are done, and the run's import path.
PAYLOAD_ENV, READY_ENV, PATH_ENV = "AUTOTUNE_FORK_PAYLOAD", "AUTOTUNE_FORK_READY", "AUTOTUNE_FORK_PATH"


def kill_worker(pid: int) -> None:
    """Kill a worker with everything it started (its own session); a forked one killed before
    it made its session is killed alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop_worker(proc: Any, *ends: Any) -> None:
    """Kill a worker process with everything it started (its own session), reap it, and close
    the ends of its pipes."""
    kill_worker(proc.pid)
    proc.wait()
    for end in ends:
        end.close()


class _Forked:
    """A forked worker behind the part of ``subprocess.Popen``'s interface the runner uses."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return self._process.exitcode


@contextlib.contextmanager
def environ_with(extra: Mapping[str, str]) -> Iterator[None]:
    """While the block runs, this process's environment holds ``extra`` too; afterwards each of
    its names is as it was (unset where it was unset).

    Example:
        >>> import os
        >>> with environ_with({"AUTOTUNE_EXAMPLE": "1"}):
        ...     os.environ["AUTOTUNE_EXAMPLE"]
        '1'
        >>> "AUTOTUNE_EXAMPLE" in os.environ
        False
    """
    kept = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in kept.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _start_method_left() -> Iterator[None]:
    """multiprocessing, preparing a server or a child, fixes this process's default start
    method: it is put back unchosen, so a user's own ``set_start_method`` still works."""
    import multiprocessing.context

    default = multiprocessing.context._default_context
    chosen = default._actual_context
    try:
        yield
    finally:
        default._actual_context = chosen


def _server() -> Any:
    from multiprocessing import forkserver

    return forkserver._forkserver  # the process-wide one multiprocessing's forkserver context uses


class ForkServer:
    """The run's fork server, started beside its first worker: ``context`` forks workers, or is
    ``None`` where none could start."""

    def __init__(self, payload: bytes, folder: Path, env: dict[str, str]) -> None:
        import multiprocessing

        self.context: Any = None
        self.path, self.ready = folder / "payload.pt", folder / "ready"
        if "forkserver" not in multiprocessing.get_all_start_methods():
            return
        try:
            import psutil

            if psutil.virtual_memory().available < 4 * len(payload) or _server()._forkserver_pid is not None:
                return  # no room for its imports beside the workers, or a server of the user's own
            folder.mkdir(parents=True, exist_ok=True)
            self.ready.unlink(missing_ok=True)
            with open(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(payload)  # read and removed by the server's preload
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["autotune.trial.forkinit"])
            # The server's environment is this one's when it starts, with the workers' own (the
            # compile cache's folder, which the compiler's settings read at their import).
            extra = {
                **env,
                PAYLOAD_ENV: str(self.path),
                READY_ENV: str(self.ready),
                PATH_ENV: os.pathsep.join(sys.path),
            }
            with environ_with(extra), _start_method_left():
                _server().ensure_running()  # starts it now, importing beside the first worker's start
            self.context = context
        except Exception:  # no server: workers start as fresh interpreters
            self.close()

    def fork(self, inbox: Any, outbox: Any, log_path: Path, env: dict[str, str]) -> _Forked | None:
        """A worker forked from the server, reading ``inbox`` and writing ``outbox``, or
        ``None`` where the server is not ready (still importing, or stuck in a user's import)
        or the fork failed."""
        from multiprocessing import process as mp_process
        from multiprocessing import spawn

        from autotune.trial.worker import forked_main

        if self.context is None or not self.ready.exists():
            return None
        prepare = spawn.get_preparation_data

        def without_main(name: str) -> dict[str, Any]:
            # A forked child would import the user's main script again (as multiprocessing's
            # spawn does), running a script without a main guard once more: the worker needs
            # nothing of it (the payload carries the model, data and metric by value).
            return {k: v for k, v in prepare(name).items() if not k.startswith("init_main")}

        try:
            process = self.context.Process(
                target=forked_main,
                args=(inbox, outbox, str(log_path), env, os.getpid()),
                name="autotune-worker",
                daemon=False,
            )
            spawn.get_preparation_data = without_main
            try:
                with _start_method_left():
                    process.start()
            finally:
                spawn.get_preparation_data = prepare
                # Not joined at this process's exit (multiprocessing would wait for a worker a
                # crash left behind): the runner stops its workers.
                mp_process._children.discard(process)
        except Exception:
            self.close()  # a server that failed once is not asked again
            return None
        return _Forked(process)

    def close(self) -> None:
        """Stop the server, where this one started it (its workers stopped first)."""
        started, self.context = self.context is not None, None
        self.path.unlink(missing_ok=True)
        self.ready.unlink(missing_ok=True)
        server = _server()
        if not started or server._forkserver_pid is None:
            return
        try:
            with server._lock:
                os.close(server._forkserver_alive_fd)
                kill_worker(server._forkserver_pid)  # killed: a stuck worker would keep it waiting
                os.waitpid(server._forkserver_pid, 0)
                server._forkserver_pid = server._forkserver_alive_fd = None
                if server._forkserver_address and not server._forkserver_address.startswith("\0"):
                    Path(server._forkserver_address).unlink(missing_ok=True)
                server._forkserver_address = None
        except (OSError, TypeError):
            pass


def launch(read_fd: int, write_fd: int, log_path: Path, env: dict[str, str], server: ForkServer | None) -> Any:
    """Start a worker that reads messages from ``read_fd`` and writes replies to ``write_fd``
    (both its ends, which the caller closes afterwards), with ``env`` over this process's
    environment and its output in ``log_path``, in a session of its own (Ctrl-C reaches only the
    parent, which then stops it cleanly): forked from ``server`` where it can be, else a fresh
    interpreter. Returns its process, as ``subprocess.Popen`` gives it."""
    from multiprocessing.connection import Connection

    if server is not None and server.context is not None:
        inbox, outbox = Connection(os.dup(read_fd), writable=False), Connection(os.dup(write_fd), readable=False)
        try:
            proc = server.fork(inbox, outbox, log_path, env)
        finally:
            inbox.close()
            outbox.close()
        if proc is not None:
            return proc
    full = dict(os.environ)
    # The worker imports the user's modules the way this process does.
    full["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full.update(env)
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "autotune.trial.worker", str(read_fd), str(write_fd), str(os.getpid())],
            pass_fds=(read_fd, write_fd),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full,
            start_new_session=True,
        )
    finally:
        log.close()
