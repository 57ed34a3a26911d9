"""Process isolation: one worker process runs trials, the parent enforces timeouts and
replaces the worker after any fault.

The first worker is a fresh interpreter (``python -m autotune.trial.worker``), never a fork of
this process, so it is safe after CUDA was used and the user's main script is not re-run; on a
CPU run the later ones fork from a server started beside it that imported what the payload
needs and ran nothing (:mod:`autotune.trial.forked`). The model, dataset and metric travel once
per worker start, pickled by value with cloudpickle: script and notebook classes work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from autotune.errors import InputError, TrialError
from autotune.export.scratch import Scratch
from autotune.trial.forked import ForkServer, kill_worker, launch, stop_worker
from autotune.trial.spec import TrialResult, pickle_spec

__all__ = ["Runner", "SubprocessRunner", "pickle_spec"]

_FAULTS_NEEDING_RESTART = {"oom", "timeout", "crash", "error"}


class Runner:
    """Runs configurations; the base of the subprocess and in-process runners."""

    info: dict[str, Any]

    timeout: float = 600.0
    # Whether :meth:`restart` gives a new process (a worker process's runner does).
    restarts: bool = False
    # A time.monotonic() instant no wait goes past (a run's ``timeout``): trials, calls and
    # worker restarts get at most what is left of it; ``None``: no limit.
    deadline: float | None = None
    # What a restart costs: the last start's seconds (``None`` before one), or a fork's where later workers fork.
    start_s: float | None = None
    # Called with each phase the running trial enters (:mod:`autotune.trial.phase`) and
    # :attr:`running`; ``None``: nobody listens.
    on_phase: Any = None
    # The trial being measured, as (number, configuration); ``None`` between trials (a call's phases).
    running: tuple[int, dict[str, Any]] | None = None

    def said(self, phase: str) -> None:
        """The running trial entered ``phase``: tell :attr:`on_phase`."""
        if self.on_phase is not None:
            self.on_phase(phase, self.running)

    def bounded(self, seconds: float) -> float:
        """``seconds``, or less: no more than what is left until :attr:`deadline` (0 once past it)."""
        if self.deadline is None:
            return seconds
        return max(0.0, min(seconds, self.deadline - time.monotonic()))

    def at_deadline(self, seconds: float) -> bool:
        """Whether the run's :attr:`deadline`, not ``seconds``, is what limits a wait."""
        return self.deadline is not None and self.deadline - time.monotonic() < seconds

    def _too_late(self, doing: str, needs_s: float) -> TrialError | None:
        """The error for work that cannot start before the deadline: less is left than
        ``needs_s`` (a measured cost), or nothing at all."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left > max(needs_s, 0.5):
            return None
        return TrialError("deadline", f"{doing} was not started: {max(left, 0.0):.1f} s were left before the "
                                      f"run's deadline and it needs about {needs_s:.1f} s")  # fmt: skip

    def run(
        self, config: dict[str, Any], timeout: float | None = None, fidelity: dict[str, Any] | None = None
    ) -> TrialResult:
        """Measure one configuration within ``timeout`` seconds (default :attr:`timeout`);
        return what became of it (a worker that died or hung is a result too). ``fidelity``:
        see :meth:`~autotune.trial.context.Context.run_trial`."""
        raise NotImplementedError

    def call(self, name: str, *args: Any, n_trials: int = 1) -> dict[str, Any]:
        """Run a method of the worker's context (:class:`~autotune.trial.context.Context`) (``verify``, ``held_out``, ``export``) in the worker.

        ``n_trials`` is how many trials' worth of work it does: it may take that many times :attr:`timeout`.

        Raises:
            TrialError: the method raised or the worker failed.
        """
        raise NotImplementedError

    def interrupt(self) -> None:
        """Stop the trial in flight from another thread, if the runner can (a worker process can)."""

    def ensure(self) -> None:
        """Start the worker now if none runs (a trial killed at a deadline left none): the time
        left a call is told of then counts from after the start. Raises TrialError as a start does."""

    def restart(self, spare: bool = False) -> bool:
        """Measure from a fresh process from now on, if the runner can (a worker process can);
        ``spare``: start a second fresh process beside it, for the next restart (see
        :meth:`SubprocessRunner.restart`). Returns whether the next call runs in a new process."""
        return False

    def close(self) -> None:
        """Stop the worker, if any."""


def _not_started(started: float) -> TrialResult:
    reason = "not started: the run's deadline had passed"
    return TrialResult("timeout", "deadline", reason, {"trial_s": time.perf_counter() - started, "ran": False})


class SubprocessRunner(Runner):
    """Runs trials in a worker process, restarted after every fault.

    Args:
        payload: The pickled :class:`~autotune.trial.worker.WorkerSpec`.
        trial_timeout: Seconds the worker's start, and by default a trial, may take before the
            worker is killed; :attr:`timeout` (the default of each trial and call) may be changed.
        log_path: Where the worker's stdout and stderr go.
        env: Extra environment variables of the worker process, e.g. ``CUDA_VISIBLE_DEVICES``
            to pin it to one GPU.
        fork: Fork the workers after the first from a server started beside it (a CPU run's:
            :mod:`autotune.trial.forked`).
    """

    def __init__(
        self,
        payload: bytes,
        trial_timeout: float,
        log_path: Path,
        env: dict[str, str] | None = None,
        fork: bool = False,
    ) -> None:
        self._payload = payload
        self._fork, self._server = fork, None
        self._timeout = trial_timeout
        self.timeout = trial_timeout
        self._log_path = log_path
        self._scratch = Scratch()  # the workers' candidate files, removed as each ends
        self._env = {**(env or {}), **self._scratch.env}
        self._proc: subprocess.Popen[bytes] | None = None
        self._busy = False  # a request is in flight: the worker will not read "stop" soon
        self._spare: tuple[Any, ...] | None = None  # a fresh worker started for the next restart
        self._known: dict[str, Any] = {}  # what the first worker learned of the baseline
        self.n_starts, self._last_s, self._init_s = 0, None, None
        self.info = self._start()

    def _start(self) -> dict[str, Any]:
        self._proc, self._send, self._recv, begun = self._launch()
        return self._ready(begun)

    def _launch(self) -> tuple[Any, Any, Any, float]:
        """Start a worker process and send it the run's payload: (process, sending and receiving
        ends, when it began); :meth:`_ready` waits for it."""
        from multiprocessing.connection import Connection

        # A start that cannot be ready before the deadline is not begun: the last one's time is
        # what the next costs (the first start is bounded by the deadline alone).
        late = self._too_late("starting a worker", self.start_s or 0.0)
        if late is not None:
            raise late
        begun = time.monotonic()
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            proc = launch(to_child_r, from_child_w, self._log_path, self._env, self._server)
        except BaseException:
            os.close(to_child_w)
            os.close(from_child_r)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        if self._fork and self._server is None:
            # Beside the first worker's start, before anything is timed: later workers fork from it.
            self._server = ForkServer(self._payload, self._log_path.parent / f"{self._log_path.stem}-server", self._env)
        send, recv = Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)
        self.n_starts += 1
        # A later start is `checked`: the first worker checked the model and the data, so this one
        # makes the baseline's reference only if something reads it (rounds never do), and gets
        # what the first learned of the baseline that its builds read.
        send.send(("init", self._payload, (self._known or True) if self.n_starts > 1 else False))
        return proc, send, recv, begun

    def _ready(self, begun: float) -> dict[str, Any]:
        """Wait for the worker just launched to be ready: its info, or the error of its start."""
        cut = self.at_deadline(self._timeout)
        reply = self._wait(self.bounded(self._timeout), "starting the worker")
        if reply[0] == "ready":
            self._last_s = time.monotonic() - begun
            self._init_s = self._init_s or reply[1].get("init_s")  # the first's: a fresh interpreter's
            self._known = self._known or reply[1].get("known") or {}
            return reply[1]
        if reply[1] == "timeout" and cut:
            reply = ("fail", "deadline", f"{reply[2]}, at the run's deadline")
        self._shutdown()  # the runner may be used again (a spare that failed, a restart cut off)
        if reply[1] == "input":
            raise InputError(reply[2])
        where = f" (the traceback is in {self._log_path})" if reply[1] == "error" else ""
        raise TrialError(reply[1], f"The trial worker failed to start: {reply[2]}{where}")

    def _log_tail(self, n: int = 6) -> str:
        try:
            lines = self._log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        tail = " | ".join(line.strip() for line in lines[-n:] if line.strip())
        return f"; worker log: {tail}" if tail else ""

    def _wait(self, timeout: float, doing: str) -> tuple[Any, ...]:
        # Stays True if Ctrl-C lands while waiting, so close() kills instead of waiting for the trial.
        self._busy = True
        reply = self._wait_unguarded(timeout, doing)
        self._busy = False
        return reply

    def _wait_unguarded(self, timeout: float, doing: str) -> tuple[Any, ...]:
        if self._proc is None:
            return ("fail", "crash", f"the worker was gone while {doing}")
        until = time.monotonic() + timeout
        try:
            while ready := self._recv.poll(max(0.0, until - time.monotonic())):
                reply = self._recv.recv()
                if reply[0] != "phase":
                    return reply
                self.said(reply[1])  # what the trial does now: news for the display, not its result
        except (EOFError, OSError):
            ready = True
        if not ready:
            self._kill()
            return ("fail", "timeout", f"no result within {timeout:g} s while {doing}; the worker was killed")
        code = self._proc.wait()
        self._scratch.drop(self._proc.pid)
        self._proc = None
        if code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if code == -signal.SIGKILL:
                how += " (by the system's out-of-memory killer, if nobody else sent it)"
        else:
            how = f"exited with code {code}"
        return ("fail", "crash", f"the worker {how} while {doing}{self._log_tail()}")

    def _kill(self) -> None:
        if self._proc is None:
            return
        kill_worker(self._proc.pid)
        self._proc.wait()
        self._scratch.drop(self._proc.pid)
        self._proc = None

    def ensure(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:  # died while idle
                self._scratch.drop(self._proc.pid)
            self._proc = None
            self.info = self._start()

    def run(
        self, config: dict[str, Any], timeout: float | None = None, fidelity: dict[str, Any] | None = None
    ) -> TrialResult:
        started = time.perf_counter()
        timeout = self.timeout if timeout is None else timeout
        try:
            self.ensure()
        except TrialError as exc:
            if exc.kind != "deadline":
                raise
            return TrialResult(
                "timeout", "deadline", str(exc), {"trial_s": time.perf_counter() - started, "ran": False}
            )
        if self.bounded(timeout) <= 0:
            return _not_started(started)
        message = ("trial", config, fidelity)
        try:
            self._send.send(message)
        except (BrokenPipeError, OSError):
            self._kill()
            self.ensure()
            self._send.send(message)
        reply = self._wait(self.bounded(timeout), "running the trial")
        if reply[0] == "fail":
            self._kill()
            return TrialResult(reply[1], reply[1], reply[2], {"trial_s": time.perf_counter() - started})
        result: TrialResult = reply[1]
        if result.status in _FAULTS_NEEDING_RESTART:
            # CUDA errors are sticky and a failed compile can leave caches half-built.
            self._kill()
        result.metrics["wall_s"] = time.perf_counter() - started
        return result

    def call(self, name: str, *args: Any, n_trials: int = 1) -> dict[str, Any]:
        self.ensure()
        late = self._too_late(name, 0.0)
        if late is not None:
            raise late
        asked = self.timeout * n_trials
        limit = self.bounded(asked)
        self._send.send(("call", name, *args))
        reply = self._wait(limit, f"running {name}")
        if reply[0] == "fail" or "error" in reply[1]:
            self._kill()
            # Cut off by the run's deadline, not by its own limit: the work was not at fault.
            kind = "deadline" if reply[0] == "fail" and reply[1] == "timeout" and limit < asked else "error"
            raise TrialError(kind, f"{name} failed in the worker: {reply[-1]}")
        return reply[1]

    restarts = True

    def restart(self, spare: bool = False) -> bool:
        """A fresh worker from now on: the spare one, where an earlier restart started one, else
        a new one; with ``spare``, a second fresh one starts beside it and waits, started and
        idle, for the next restart. A confirmation's two fresh workers each took 4 s to start
        (torch, then the user's model and its modules: a Hugging Face model's imports were 3 s
        of it); started together, the second costs nothing more. Not where the deadline or the
        machine's free memory (the spare holds the model too) leaves no room for it. The worker
        it replaces is idle: killed, not asked to stop (its exit took a second of each restart)."""
        self._kill()
        if self._spare is not None:
            self._proc, self._send, self._recv, self.info = self._spare
            self._spare = None
            return True
        if not spare or not self._spare_fits():
            self.ensure()
            return True
        first = self._launch()
        try:
            second = self._launch()
        except Exception:  # the deadline, or no process to be had: no spare
            second = None
        self._proc, self._send, self._recv, begun = first
        try:
            self.info = self._ready(begun)
        finally:
            if second is not None and self._proc is None:  # the first failed: no spare either
                stop_worker(*second[:3])
                second = None
        if second is not None:
            kept = (self._proc, self._send, self._recv, self.info, self._last_s)
            self._proc, self._send, self._recv, begun = second
            try:
                self._spare = (self._proc, self._send, self._recv, self._ready(begun))
            except (TrialError, InputError):
                pass  # _ready stopped it: the next restart starts one
            finally:
                if self._spare is None and self._proc is not None:  # interrupted while it started
                    stop_worker(self._proc, self._send, self._recv)
                self._proc, self._send, self._recv, self.info, self._last_s = kept
        return True

    def _spare_fits(self) -> bool:
        """Whether a second worker may start now: before the deadline, with room in memory for
        another copy of the run's payload (the model and the data) beside the others."""
        import psutil

        room = psutil.virtual_memory().available > 4 * len(self._payload)
        return room and self._too_late("starting a spare worker", 2 * (self.start_s or 0.0)) is None

    def interrupt(self) -> None:
        """Kill the worker from another thread; the thread waiting on it gets a ``crash`` reply
        and reaps it (unlike :meth:`close`, this leaves the process handle to that thread)."""
        proc = self._proc
        if proc is not None:
            kill_worker(proc.pid)

    @property
    def start_s(self) -> float | None:
        """What a restart costs: the last start's seconds, or, where the next worker forks from
        a server that is ready, what the first did past its imports (a fork does that at most)."""
        server = self._server
        if self._init_s is None or server is None or server.context is None or not server.ready.exists():
            return self._last_s
        return min(self._last_s or self._init_s, self._init_s)

    def close(self) -> None:
        self._shutdown()
        self._scratch.close()

    def _shutdown(self) -> None:
        self._stop_current()
        if self._spare is not None:
            stop_worker(*self._spare[:3])
            self._spare = None
        if self._server is not None:
            self._server.close()

    def _stop_current(self) -> None:
        if self._proc is None:
            return
        if not self._busy:  # idle: asked to stop first (Ctrl-C while it worked: killed at once)
            try:
                self._send.send(("stop",))
                self._proc.wait(timeout=10)
            except Exception:
                pass
        # Reaped too: a killed busy worker was left to die on its own, still running a moment
        # after close() in one test run of six.
        self._kill()
