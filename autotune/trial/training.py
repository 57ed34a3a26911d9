"""A training trial: real optimizer steps on the real DataLoader, timed end to end and guarded by
the loss curve.

Every trial starts from the same initial weights and reads the same samples in the same order
(:class:`~autotune.trial.train_setup.FixedOrder`). The first ``n_train_steps`` optimizer steps are the guard:
their losses are compared with the baseline's (the first ``warmup_batches`` of them, where
compilation happens, are timed apart as ``compile_s``). The timed windows continue training from
there.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from autotune._pristine import restore
from autotune.config import values_of
from autotune.errors import InputError, TrialError
from autotune.export.run_cache import model_digest
from autotune.trial.build import settings_active
from autotune.trial.context import Context
from autotune.trial.measure import (
    Interference,
    MeasureSettings,
    _peak_mib,
    _sync,
    is_busy,
    memory_mark,
    noise_reason,
    size_bytes,
    window_stats,
)
from autotune.trial.phase import say
from autotune.trial.train_setup import FixedOrder, TrainingSetup, optimizer_factory, prepare, train_metric

__all__ = ["TrainContext"]

# A float16 run whose gradient scaler skips more steps than this share (after the first few,
# while the scale settles) is not learning: an overflow storm.
_MAX_SKIPPED_SHARE = 0.25
_SETTLING_SKIPS = 3


@dataclasses.dataclass
class GuardRun:
    """The first optimizer steps of a trial, and the setup ready to go on training."""

    setup: TrainingSetup
    batches: Iterator[Any]
    losses: list[float]
    skipped: int
    compile_s: float


def run_guard_steps(setup: TrainingSetup, loss_fn: Any, n_samples: int, warmup_steps: int, seed: int) -> GuardRun:
    """Train ``setup`` over ``n_samples`` samples (at least two steps), recording each step's loss
    and how many steps a float16 gradient scaler skipped."""
    torch.manual_seed(seed)  # dropout and other randomness start alike in every trial
    batches = iter(setup.loader)
    n_steps = max(2, n_samples // setup.effective_batch_size)
    losses, skipped = [], 0
    start = time.perf_counter()
    compile_s = 0.0
    for i in range(n_steps):
        scale = setup.scaler.get_scale() if setup.scaler.is_enabled() else None
        losses.append(setup.step(batches, loss_fn).item())
        if scale is not None and setup.scaler.get_scale() < scale:
            skipped += 1
        if i + 1 == min(warmup_steps, n_steps):
            _sync(torch.device(setup.device))
            compile_s = time.perf_counter() - start
    return GuardRun(setup, batches, losses, skipped, compile_s)


def final_loss(losses: list[float]) -> float:
    """Mean loss over the last quarter of the steps (at least one): the level the run reached."""
    tail = losses[-max(1, len(losses) // 4) :]
    return statistics.fmean(tail)


def check_curve(run: GuardRun) -> None:
    """Raise ``TrialError('nan')`` when the run's losses are not finite or its gradient scaler
    skipped steps in a storm."""
    bad = [i for i, v in enumerate(run.losses) if not math.isfinite(v)]
    if bad:
        raise TrialError("nan", f"the training loss became NaN/inf at step {bad[0] + 1} of {len(run.losses)}")
    allowed = max(_SETTLING_SKIPS, int(_MAX_SKIPPED_SHARE * len(run.losses)))
    if run.skipped > allowed:
        raise TrialError(
            "nan",
            f"the float16 gradient scaler skipped {run.skipped} of {len(run.losses)} steps (gradient overflow storm)",
        )


def time_steps(setup: TrainingSetup, batches: Iterator[Any], loss_fn: Any, settings: MeasureSettings) -> dict[str, Any]:
    """Training throughput: windows of whole optimizer steps, samples per second end to end
    (loader, copies, forward, loss, backward, optimizer), the device synchronised per window."""
    device = torch.device(setup.device)
    use_events = device.type == "cuda"
    windows: list[float] = []
    latencies: list[float] = []
    others: list[float] = []
    probe = Interference()
    timed_start = time.perf_counter()
    loss = None
    for _ in range(settings.n_windows):
        n_samples, events = 0, []
        probe.start()
        w_start = time.perf_counter()
        while True:
            if use_events:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                loss = setup.step(batches, loss_fn)
                end.record()
                events.append((begin, end))
            else:
                s_start = time.perf_counter()
                loss = setup.step(batches, loss_fn)
                latencies.append((time.perf_counter() - s_start) * 1e3)
            n_samples += setup.effective_batch_size
            if time.perf_counter() - w_start >= settings.window_s:
                break
        _sync(device)
        windows.append(n_samples / (time.perf_counter() - w_start))
        others.append(probe.stop())
        latencies += [b.elapsed_time(e) for b, e in events]
    if loss is not None and not math.isfinite(loss.item()):
        raise TrialError("nan", "the training loss became NaN/inf during the timed steps")
    return {
        **window_stats(windows, latencies),
        "others_cpu": sum(others) / len(others),
        "others_cpu_max": max(others),
        "timed_s": time.perf_counter() - timed_start,
        "n_windows": settings.n_windows,
    }


class TrainContext(Context):
    """A worker's state in training mode: the initial weights, the optimizer factory and the
    baseline's loss curve (and metric) from those weights."""

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.make_optimizer = optimizer_factory(spec.optimizer)
        if spec.loss_fn is None:
            raise InputError("Training mode needs `loss_fn(outputs, batch) -> Tensor`.")
        effective = spec.effective_batch_size or values_of(spec.baseline).batch_size
        self.n_guard_samples = spec.n_train_steps * effective
        try:
            run = self._guard_run(spec.baseline)
        except TrialError as exc:
            raise InputError(f"The baseline training step failed: {exc}") from None
        try:
            check_curve(run)
        except TrialError as exc:
            raise InputError(
                f"The baseline's own training is not sound: {exc}. Lower the learning rate or check loss_fn."
            ) from None
        self.reference_losses = run.losses
        self.reference_final = final_loss(run.losses)
        self.reference_metric = train_metric(run.setup, self.samples, spec.metric) if spec.metric else None
        self.info = {
            "n_params": sum(p.numel() for p in self.model.parameters()),
            "baseline_metric": self.reference_metric,
            "baseline_loss": self.reference_final,
            "n_val": len(self.samples),
            "model_digest": model_digest(self.model),  # the key of the runs' history
        }

    def setup(self, config: Mapping[str, Any]) -> TrainingSetup:
        """``config``'s training setup on a fresh copy of the initial weights, from stock process state."""
        self.reset(config)
        spec = self.spec
        chunk = spec.effective_batch_size or values_of(config).batch_size
        return prepare(
            self.fresh_model(),
            config,
            spec.device,
            self.make_optimizer,
            spec.dataset,
            effective_batch_size=spec.effective_batch_size,
            sampler=FixedOrder(len(spec.dataset), chunk, spec.seed),
            copy_model=False,
        )

    def _guard_run(self, config: Mapping[str, Any]) -> GuardRun:
        setup = self.setup(config)
        with settings_active(setup.settings):
            return run_guard_steps(
                setup, self.spec.loss_fn, self.n_guard_samples, self.spec.measure.warmup_batches, self.spec.seed
            )

    def trial(self, config: dict[str, Any], result: dict[str, Any]) -> None:
        """Train one configuration: guard steps, then timed steps (in ``world_size`` ranks under
        torchrun where it is more than one, :mod:`autotune.trial.ddp`)."""
        knobs = values_of(config)
        if knobs.world_size > 1:
            self._distributed(config, result)
            return
        device = torch.device(self.spec.device)
        mark = memory_mark(device)
        say("compiling, then checking the loss" if knobs.compile_mode != "none" else "checking the loss")
        run = self._guard_run(config)
        setup = run.setup
        result.update(
            batch_size=setup.batch_size,
            accumulation_steps=setup.accumulation_steps,
            effective_batch_size=setup.effective_batch_size,
            compile_s=run.compile_s,
            skipped_steps=run.skipped,
            n_guard_steps=len(run.losses),
        )
        check_curve(run)
        say("timing")
        with settings_active(setup.settings):
            result.update(time_steps(setup, run.batches, self.spec.loss_fn, self.spec.measure))
        # Training continues from where it is, so a noisy measurement is timed again on the next steps.
        for _ in range(self.spec.measure.n_remeasure):
            if noise_reason(result, self.spec.measure) is None:
                break
            with settings_active(setup.settings):
                again = time_steps(setup, run.batches, self.spec.loss_fn, self.spec.measure)
            if again["cov"] + again["others_cpu"] < result["cov"] + result["others_cpu"]:
                result.update(again)
        result["noise"] = noise_reason(result, self.spec.measure)
        result["noisy"] = result["noise"] is not None
        result["busy"] = is_busy(result, self.spec.measure)
        result["peak_mem_mib"] = max(0.0, _peak_mib(device) - mark)
        result["n_params"] = self.info["n_params"]
        result["size_bytes"], result["size_bytes_compressed"] = size_bytes(setup.model, compress=self.spec.sizes)
        metric = train_metric(run.setup, self.samples, self.spec.metric) if self.spec.metric is not None else None
        self._judge(run.losses, result, metric)

    def _distributed(self, config: dict[str, Any], result: dict[str, Any]) -> None:
        """``config``'s trial in its ranks (:func:`autotune.trial.ddp.launch`), judged as any."""
        import tempfile
        from pathlib import Path

        from autotune.trial.ddp import launch
        from autotune.trial.train_setup import accumulation

        knobs = values_of(config)
        world, batch = int(knobs.world_size), int(knobs.batch_size)
        effective = self.spec.effective_batch_size or world * batch
        if effective % world:
            raise TrialError("unsupported", f"the effective batch size {effective} does not split into {world} ranks")
        accumulation(batch, effective // world)  # before the launch: the rank's share
        with tempfile.TemporaryDirectory(prefix="autotune-ddp-") as folder:
            got = launch(self._pickled_spec(), config, Path(folder))
        losses = got.pop("losses")
        result.update(got, batch_size=knobs.batch_size, n_guard_steps=len(losses))
        check_curve(GuardRun(None, iter(()), losses, got["skipped_steps"], got["compile_s"]))  # type: ignore[arg-type]
        result["n_params"] = self.info["n_params"]
        self._judge(losses, result, got.get("metric"))

    def _pickled_spec(self) -> bytes:
        """The spec as the ranks read it, pickled once for every distributed trial and round (the
        dataset goes with it)."""
        if getattr(self, "_spec_bytes", None) is None:
            from autotune.trial.spec import pickle_spec

            self._spec_bytes = pickle_spec(self.spec)
        return self._spec_bytes

    def _judge(self, losses: list[float], result: dict[str, Any], metric: float | None = None) -> None:
        """The guard: the final loss level within ``loss_tolerance`` of the baseline's (relative),
        or, with a user metric, ``metric`` (after the steps) within ``max_metric_drop``."""
        final = final_loss(losses)
        change = (final - self.reference_final) / max(abs(self.reference_final), 1e-12)
        result.update(loss_first=losses[0], loss_final=final, loss_rel_change=change)
        if self.spec.metric is not None:
            result["metric"], result["metric_drop"] = metric, self.reference_metric - metric
            return
        result["metric_drop"] = abs(change)
        if abs(change) > self.spec.loss_tolerance + 1e-12:
            result.update(
                status="infeasible",
                kind="guard",
                reason=(
                    f"final mean loss {final:.4g} vs the baseline's {self.reference_final:.4g} "
                    f"({change:+.1%}), beyond the {self.spec.loss_tolerance:.0%} tolerance"
                ),
            )

    def prepare(self, configs: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
        # Every setup first: building a compiled one resets dynamo, which would throw away the
        # compiled code of those already warmed up and move their compilation into a timed round.
        # A distributed configuration is timed by launching its ranks in each round.
        setups = [self.setup(c) if values_of(c).world_size == 1 else dict(c) for c in configs]
        runs: list[Any] = []
        for setup in setups:
            if isinstance(setup, dict):
                runs.append((setup, None))
                continue
            restore(self.pristine)
            with settings_active(setup.settings):
                batches = iter(setup.loader)
                for _ in range(self.spec.measure.warmup_batches):
                    setup.step(batches, self.spec.loss_fn)
            runs.append((setup, batches))
        return runs

    def profile(self, config: dict[str, Any], trace: str) -> dict[str, Any]:
        """Where one training step of ``config`` spends its time (:mod:`autotune.trial.profile`),
        its trace written to ``trace``."""
        from autotune.trial.profile import profile_training

        torch.manual_seed(self.spec.seed)
        setup = self.setup(config)

        def epochs() -> Iterator[Any]:
            while True:
                yield from setup.loader

        return profile_training(setup, epochs(), self.spec.loss_fn, trace)

    def time_round(
        self,
        prepared: tuple[TrainingSetup, Iterator[Any]],
        diagnose: bool,
        seed: int = 0,
        windows: int = 0,
        window_s: float = 0.0,
    ) -> dict[str, Any]:
        """Training throughput of one warmed-up setup, continuing its training (no diagnosis in
        training mode). ``seed``, ``windows`` and ``window_s`` are unused: each round continues the setup's own
        epoch, so rounds already read different batches, over the run's timed steps."""
        setup, batches = prepared
        if isinstance(setup, dict):  # a distributed configuration: its ranks launched for this round
            m: dict[str, Any] = {}
            self._distributed(setup, m)
        else:
            with settings_active(setup.settings):
                m = time_steps(setup, batches, self.spec.loss_fn, self.spec.measure)
        row = {k: m[k] for k in ("samples_per_s", "latency_ms_p50", "latency_ms_p95", "cov")}
        row["others_cpu"] = m.get("others_cpu", 0.0)
        return row
