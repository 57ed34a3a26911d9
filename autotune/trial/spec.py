"""The two types that cross the worker pipe: what a worker is given, and what a trial returns.

:class:`WorkerSpec` is sent once when a worker starts. :class:`TrialResult` is what every trial
ends as, whether it ran, failed, timed out or was ruled out: the worker returns it, the runner
makes one for a worker that died or hung, and the study stores it as the Optuna trial's user
attributes (:meth:`TrialResult.to_attrs`) and reads it back (:meth:`TrialResult.from_attrs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from autotune.errors import InputError
from autotune.trial.measure import MeasureSettings

__all__ = ["STATUSES", "TrialResult", "WorkerSpec", "pickle_spec"]

# ok: measured and guarded; infeasible: ruled out (guard, NaN, a method that cannot apply);
# stopped: its first timed window was far below the best so far, so timing and guard stopped
# there; oom, timeout, crash, error: faults; interrupted and skipped: never finished by this worker.
STATUSES = ("ok", "infeasible", "stopped", "oom", "timeout", "crash", "error", "interrupted", "skipped")


@dataclasses.dataclass
class WorkerSpec:
    """Everything a worker needs, sent once when it starts.

    Attributes:
        model: An ``nn.Module`` or a zero-argument factory returning one.
        dataset: The map-style dataset.
        metric: ``metric(outputs, batch) -> float`` or ``None`` for fidelity.
        device: Concrete device string.
        baseline: The baseline configuration (dict).
        val_indices: Indices of the fixed validation samples.
        measure: Timing settings.
        seed: Seeds torch before the factory runs and before each trial.
        loss_fn: ``loss_fn(outputs, batch) -> Tensor`` for recovery fine-tuning, or ``None``.
        train_dataset: Fine-tuning samples (default: ``dataset``).
        prune_ignore: Module names pruning keeps whole.
        n_calibration: Batches (of the baseline batch size) for static quantization.
        test_dataset: Held-out samples, scored only after the search.
        max_metric_drop: The guard's tolerance, also applied to exported artifacts.
        mode: ``"inference"`` or ``"train"``.
        optimizer: Training mode: an optimizer class, ``(class, kwargs)`` or factory.
        effective_batch_size: Training mode: samples per optimizer step (``None``: the trial's
            batch size, no accumulation).
        n_train_steps: Training mode: optimizer steps of the loss-curve guard (at the baseline's
            effective batch size; the same number of samples for every trial).
        loss_tolerance: Training mode: largest relative change of the final mean loss.
        output_kind: How fidelity judges each output (see :func:`autotune.trial.fidelity.infer_kinds`).
        collate_fn: The base collate of every batch (the user's or the padding collate), or
            ``None`` for ``default_collate``.
        sequence: The samples are token sequences: batched by the ``padding`` and
            ``length_grouping`` knobs and compared sample by sample.
        images: The samples are images whose size varies: batched by the ``image_padding`` and
            ``size_grouping`` knobs.
        int8_rankings: INT8 sensitivity rankings the study holds already, by their key
            (:func:`autotune.compress.fallback.ranking_key`).
        int8_store: Where a worker writes each ranking once computed and reads before ranking
            (:class:`autotune.compress.fallback.StudyRankings`), or ``None``.
        sizes: Each measured trial's weights are compressed for their size (``size_bytes_compressed``),
            which the ``size`` objective minimizes and a Pareto front lists. Nothing else reads it,
            and zlib took 4-5 s of each distinct float build of real MiniLM (the baseline's trial,
            OpenVINO bf16's): 10 s of a 16-trial run that optimizes speed alone.
    """

    model: Any
    dataset: Any
    metric: Callable[[Any, Any], float] | None
    device: str
    baseline: dict[str, Any]
    val_indices: list[int]
    measure: MeasureSettings
    seed: int = 0
    loss_fn: Callable[[Any, Any], Any] | None = None
    train_dataset: Any = None
    prune_ignore: tuple[str, ...] = ()
    n_calibration: int = 8
    test_dataset: Any = None
    max_metric_drop: float = 0.01
    mode: str = "inference"
    optimizer: Any = None
    effective_batch_size: int | None = None
    n_train_steps: int = 20
    loss_tolerance: float = 0.05
    output_kind: Any = "auto"
    collate_fn: Callable[[list[Any]], Any] | None = None
    sequence: bool = False
    images: bool = False
    int8_rankings: dict[str, str] = dataclasses.field(default_factory=dict)
    int8_store: Any = None
    sizes: bool = True


@dataclasses.dataclass
class TrialResult:
    """What became of one trial.

    Attributes:
        status: One of :data:`STATUSES`.
        kind: The fault's or rule's kind (``"guard"``, ``"nan"``, ``"compile"``, ``"oom-rule"``,
            ``"deadline"``, ...) or ``None``.
        reason: One line that says why, or ``None`` for a clean ``ok``.
        metrics: Everything measured (``samples_per_s``, ``metric_drop``, ``trial_s``, ...) and
            the study's own fields (``config``, ``key``, ``ran``, ...), JSON-safe.

    Example:
        >>> r = TrialResult.from_attrs({"status": "oom", "kind": "oom", "reason": "x", "trial_s": 1.5})
        >>> r.status, r.metrics["trial_s"], r.to_attrs()["reason"]
        ('oom', 1.5, 'x')
    """

    status: str = "ok"
    kind: str | None = None
    reason: str | None = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Measured, and the guard held."""
        return self.status == "ok"

    def fail(self, status: str, kind: str | None, reason: str | None) -> None:
        """Mark the trial failed or ruled out; what was measured before stays."""
        self.status, self.kind, self.reason = status, kind, reason

    def to_attrs(self) -> dict[str, Any]:
        """The flat dict the study stores as user attributes (and trials.csv shows)."""
        return {"status": self.status, "kind": self.kind, "reason": self.reason, **self.metrics}

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> TrialResult:
        """The result stored as ``attrs`` (:meth:`to_attrs`' output, or a trial's user attributes)."""
        rest = {k: v for k, v in attrs.items() if k not in ("status", "kind", "reason")}
        return cls(attrs.get("status", "ok"), attrs.get("kind"), attrs.get("reason"), rest)


def pickle_spec(spec: Any) -> bytes:
    """Pickle a worker spec, or say what to do when the model or dataset cannot travel.

    torch.save's pickler stores each tensor storage once; a plain pickle would copy the whole
    storage for every view of it (a dataset of rows sliced from one tensor would grow by a
    factor of its length). cloudpickle is its pickler, so script-defined classes travel by value,
    their functions' globals as a module the worker registers (:mod:`autotune.trial.usercode`).
    """
    import io

    import torch

    from autotune.trial.usercode import hand_loaded_by_value, pickle_module

    hand_loaded_by_value()
    buf = io.BytesIO()
    try:
        torch.save(spec, buf, pickle_module=pickle_module)
        return buf.getvalue()
    except Exception as exc:
        raise InputError(
            f"The model, dataset or metric cannot be sent to a trial worker ({type(exc).__name__}: {exc}). "
            "Pass a zero-argument function that builds the model, define them in a cfg.py, or use "
            "isolation='inprocess'."
        ) from None
