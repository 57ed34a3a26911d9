"""What inference and training workers share: the untouched model, the fixed validation
samples, the process state restored before every build, a trial that never raises, and
interleaved measurement rounds.

A context lives in one worker for the whole study. Subclasses say how one configuration is
prepared (:meth:`Context.prepare`), tried (:meth:`Context.trial`) and timed for one round
(:meth:`Context.time_round`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import Any

import torch

from autotune._pristine import restore, snapshot
from autotune.config import values_of
from autotune.env import use_device
from autotune.errors import InputError
from autotune.trial.faults import one_line, record_fault
from autotune.trial.intervals import enough_rounds
from autotune.trial.measure import draw_seed
from autotune.trial.memory import check_host_memory
from autotune.trial.spec import TrialResult, WorkerSpec

__all__ = ["Context", "compiles", "instantiate_model"]


def compiles(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` builds with ``torch.compile`` (and so resets dynamo before its build)."""
    return values_of(config).compile_mode != "none"


def instantiate_model(spec: WorkerSpec) -> torch.nn.Module:
    """The spec's model: the module itself, or what its factory returns."""
    model = spec.model
    if not isinstance(model, torch.nn.Module):
        try:
            model = model()
        except Exception as exc:
            raise InputError(f"The model factory raised {one_line(exc)}") from exc
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"The model factory must return a torch.nn.Module, but returned {type(model).__name__}.")
    from autotune.export.hf import as_module

    return as_module(model)  # a SentenceTransformer, called as every phase calls a model


class Context:
    """A worker's state for one study.

    Attributes:
        pristine: The process state (threads, backend flags, compiler config) as the worker found
            it, restored before every build and every measurement.
        spec: What the worker was given.
        model: The user's model, never changed: every build works on a fresh copy.
        samples: The fixed validation samples, in dataset order.
        info: Facts sent to the parent when the worker is ready.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.pristine = snapshot()
        self.spec = spec
        use_device(spec.device)  # events and streams on the model's device (see use_device)
        torch.manual_seed(spec.seed)
        self.model = instantiate_model(spec)
        self.samples = [spec.dataset[i] for i in spec.val_indices]
        self._read: dict[tuple[Any, ...], list[Any]] = {}  # the samples as other data paths read them
        self.info: dict[str, Any] = {}
        self.n_rounds = 0  # rounds timed so far: each draws its own batches
        # How fully the trial in flight is timed (see run_trial); empty: fully.
        self.fidelity: dict[str, Any] = {}

    def samples_for(self, state: Any) -> list[Any]:
        """The validation samples as ``state``'s loader reads them: :attr:`samples`, unless the
        configuration sets a knob that reads samples another way (``reads_samples``: JPEGs
        decoded at reduced scale, or on the device), whose effect the guard must judge too.
        Read once per such path in this worker."""
        from autotune.knobs import off_default

        changed = off_default(state.config, "reads_samples") if state.config is not None else ()
        if not changed:
            return self.samples
        key = tuple((name, state.config[name]) for name in changed)
        if key not in self._read:
            from autotune.trial.build import read_samples

            self._read[key] = read_samples(self.spec.dataset, self.spec.val_indices, state)
        return self._read[key]

    def fresh_model(self) -> torch.nn.Module:
        """An untouched copy of the model for one build: a deep copy, or the factory's output
        (in the same train/eval mode) when the model cannot be copied (it holds a lock, say)."""
        try:
            return copy.deepcopy(self.model)
        except Exception as exc:
            if isinstance(self.spec.model, torch.nn.Module):
                raise InputError(
                    f"The model cannot be copied for each trial ({one_line(exc)}). Pass a zero-argument "
                    "function that builds it instead."
                ) from exc
            torch.manual_seed(self.spec.seed)
            return self.spec.model().train(self.model.training)

    def reset(self, config: Mapping[str, Any]) -> None:
        """Stock process state before a build; a fresh compiler cache before a compiled one, so
        the recompilation limit cannot silently fall back to eager after a few trials."""
        restore(self.pristine)
        if compiles(config):
            torch._dynamo.reset()

    def run_trial(self, config: dict[str, Any], fidelity: Mapping[str, Any] | None = None) -> TrialResult:
        """Try one configuration; never raises: a fault is recorded in the result, with what
        was measured before it.

        ``fidelity`` may shorten its timing: ``share`` of the timed windows (a screening
        trial), and the ``best`` samples/s so far, a share of which (the timing settings'
        ``stop_share``) stops it early (far below the best: the guard is not run
        and the trial is ``stopped``); ``paired`` (the baseline): a measurement whose windows
        disagree on a quiet machine is kept, not taken again (the finish times it beside the pick)."""
        started = time.perf_counter()
        flat: dict[str, Any] = {"status": "ok", "kind": None, "reason": None}
        result = TrialResult()
        self.fidelity = dict(fidelity or {})
        try:
            # Priced before the build: a trial whose batches in flight would not fit the host's
            # shared or available memory is not started (it would kill its workers, or the machine).
            check_host_memory(config, self.sample_bytes * int(values_of(config).batch_size or 1))
            self.trial(config, flat)
        except Exception as exc:
            record_fault(result, exc, self.spec.device)
            flat.update(status=result.status, kind=result.kind, reason=result.reason)
        flat["trial_s"] = time.perf_counter() - started
        return TrialResult.from_attrs(flat)

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample's tensors (the first validation sample's)."""
        from autotune.samples import tensor_leaves

        if not self.samples:
            return 0
        return sum(t.numel() * t.element_size() for t in tensor_leaves(self.samples[0]) if hasattr(t, "element_size"))

    def trial(self, config: dict[str, Any], result: dict[str, Any]) -> None:
        """Build, measure and guard ``config``, filling ``result`` as figures come in (a guard
        that rejects the candidate sets ``status``, ``kind`` and ``reason``)."""
        raise NotImplementedError

    def prepare(self, configs: list[dict[str, Any]]) -> list[Any]:
        """What :meth:`time_round` times for each configuration, ready (built, warmed up)."""
        raise NotImplementedError

    def time_round(
        self, prepared: Any, diagnose: bool, seed: int = 0, windows: int = 0, window_s: float = 0.0
    ) -> dict[str, Any]:
        """One round's timing of a prepared configuration: ``samples_per_s``, latencies, ``cov``,
        ``others_cpu`` (and, with ``diagnose``, its loader and model alone), reading the batches
        ``seed`` draws (see :func:`~autotune.trial.measure.measure`), over ``windows`` timed
        windows (0: the worker's own number for a round)."""
        raise NotImplementedError

    def rounds(
        self,
        configs: list[dict[str, Any]],
        n_min: int,
        n_max: int,
        target: float | None = None,
        max_s: float | None = None,
        diagnose: bool = False,
        drawn: int = 0,
        until_s: float | None = None,
        builds_free: bool = False,
        windows: int = 0,
        window_s: float = 0.0,
    ) -> dict[str, Any]:
        """Measure ``configs`` in interleaved rounds whose order alternates (A, B, C / C, B, A).

        After ``n_min`` rounds they stop once ``max_s`` seconds have passed or, with ``target``
        and two configurations, once the 95% interval of ``configs[1]``'s ratio to ``configs[0]``
        is within +-``target``; never after more than ``n_max`` rounds. With ``diagnose``, the
        first round also times every configuration's loader alone and model alone
        (:mod:`autotune.trial.diagnose`; the model's half from the rounds' own windows where
        the batches load in this process on the CPU,
        :func:`~autotune.trial.diagnose.model_from_rounds`), so the diagnosis comes from the same
        rounds as the end-to-end figures; in every round they made a confirmation half as long
        again (three rounds of real MiniLM: 33 s more), for figures that explain the claim, not
        make it.
        ``drawn``: rounds an earlier worker process already drew batches for; this one draws
        after them. ``until_s``: seconds after which the caller stops waiting (the run's
        deadline): a round that would end past it is not begun, even short of ``n_min``, so the
        rounds already timed come back instead of none. With ``builds_free``, ``max_s`` counts
        the rounds' time and not the builds' (each configuration's build and its first warm-up,
        a compile from the run's cache): a run without a time limit gives its claim the same
        rounds whatever its pick costs to build. ``windows``: timed windows per configuration
        in a round (0: :meth:`time_round`'s own number); ``window_s``: seconds each (0: the
        timing settings' ``window_s``).

        Returns:
            ``{"rounds": [[{"samples_per_s", "latency_ms_p50", "latency_ms_p95", "cov",
            "others_cpu", ...}, ...per config], ...per round], "drawn": rounds drawn so far,
            "pid": this process, "built_s": seconds of the builds and first warm-ups}``.
        """
        import os

        from autotune.trial.diagnose import model_from_rounds

        self.n_rounds = max(self.n_rounds, drawn)
        # The builds (an export, a quantization) count against ``max_s`` like the rounds: a run's
        # deadline is given in wall time.
        started = time.perf_counter()
        prepared = self.prepare(configs)
        built = time.perf_counter() - started
        rounds: list[list[dict[str, Any]]] = []
        slowest = 0.0
        for r in range(n_max):
            began = time.perf_counter()
            if rounds and until_s is not None and began - started + slowest > until_s:
                break
            # A fresh draw of batches per round (also across calls: confirmation rounds do not
            # re-read selection's), the same for every configuration in the round, so each ratio
            # compares the same work.
            self.n_rounds += 1
            seed = draw_seed(self.spec.seed, "round", self.n_rounds)
            row: list[dict[str, Any]] = [{} for _ in prepared]
            for i in range(len(prepared)) if r % 2 == 0 else reversed(range(len(prepared))):
                restore(self.pristine)
                row[i] = self.time_round(prepared[i], diagnose and not rounds, seed, windows, window_s)
            if not rounds:  # the first warm-up of each build: its compile, where it has one
                built += sum(float(c.pop("warmup_s", 0.0)) for c in row)
            rounds.append(row)
            slowest = max(slowest, time.perf_counter() - began)
            spent = time.perf_counter() - started - (built if builds_free else 0.0)
            if enough_rounds(rounds, n_min, target, max_s, spent):
                break
        for row in rounds:
            for c in row:
                c.pop("warmup_s", None)
        model_from_rounds(rounds)  # a diagnosis's model half where its rounds timed it
        return {"rounds": rounds, "drawn": self.n_rounds, "pid": os.getpid(), "built_s": built}
