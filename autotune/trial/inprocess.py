"""The in-process runner (``isolation="inprocess"``): trials in the caller's own process, with
the run's caches of converted models shared as a worker process shares them."""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from autotune.errors import TrialError
from autotune.trial.alarm import Overrun, alarm
from autotune.trial.forked import environ_with
from autotune.trial.runner import Runner, _not_started
from autotune.trial.spec import TrialResult

__all__ = ["InProcessRunner"]

# The run's caches that the library reads from the environment at each build (its OpenVINO
# conversions and int8 models, its ONNX exports). inductor's and Triton's are left to the
# caller's process: they are read once, when inductor is first imported, and a user's own
# compiles later in the process would land in the run's folder.
_SHARED = ("AUTOTUNE_OPENVINO_CACHE", "AUTOTUNE_ONNX_CACHE")


class InProcessRunner(Runner):
    """Runs trials in this process: no protection from crashes. Timeouts interrupt the work with
    an alarm, between Python steps: a native call that never returns is not interrupted.

    Args:
        spec: The trials' :class:`~autotune.trial.spec.WorkerSpec`.
        env: The environment a worker process would get (the run's caches; those of
            :data:`_SHARED` are set while a trial or call runs, and put back after): without
            it, every OpenVINO build of real MiniLM converted the model again (a trace and a conversion,
            4-5 s each) where a worker reads the first one's from the run's cache.
    """

    _env: Mapping[str, str] = MappingProxyType({})

    def __init__(self, spec: Any, env: Mapping[str, str] | None = None) -> None:
        from autotune.trial.worker import make_context

        self._env = {k: v for k, v in (env or {}).items() if k in _SHARED}
        with environ_with(self._env):
            self._ctx = make_context(spec)
        self.info = self._ctx.info

    def run(
        self, config: dict[str, Any], timeout: float | None = None, fidelity: dict[str, Any] | None = None
    ) -> TrialResult:
        started = time.perf_counter()
        asked = self.timeout if timeout is None else timeout
        limit = self.bounded(asked)
        if limit <= 0:
            return _not_started(started)
        from autotune.trial.phase import listen

        listen(self.said)
        try:
            with alarm(limit), environ_with(self._env):
                result = self._ctx.run_trial(config, fidelity)
        except Overrun:
            reason = f"no result within {limit:g} s while running the trial; it was interrupted"
            return TrialResult("timeout", "timeout", reason, {"trial_s": time.perf_counter() - started})
        result.metrics["wall_s"] = time.perf_counter() - started
        return result

    def call(self, name: str, *args: Any, n_trials: int = 1) -> dict[str, Any]:
        late = self._too_late(name, 0.0)
        if late is not None:
            raise late
        asked = self.timeout * n_trials
        limit = self.bounded(asked)
        try:
            with alarm(limit), environ_with(self._env):
                return getattr(self._ctx, name)(*args)
        except Overrun:
            kind = "deadline" if limit < asked else "timeout"
            raise TrialError(kind, f"{name} gave no result within {limit:.1f} s; it was interrupted") from None
        except Exception as exc:
            raise TrialError("error", f"{name} failed: {type(exc).__name__}: {exc}") from exc
