"""The accuracy guard: the user's metric, or fidelity to the baseline's outputs.

Every trial runs its tuned model on the same fixed validation samples. The outputs are
compared in chunks of the baseline batch size whatever the trial's own batch size, so the
metric of every trial averages over the same batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._fidelity import attention_mask, fidelity_report, infer_kinds
from .build import BuildState, settings_active
from .data import map_tensors, pad_batch, slice_batch, tensor_leaves, to_device
from .errors import InputError, TrialError
from .measure import call_model

__all__ = ["Reference", "collect_outputs", "fidelity", "fidelity_report", "evaluate"]


_leaves = tensor_leaves  # the one definition of an output's tensors, in order


def _concat(chunks: list[Any]) -> Any:
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(chunks) if first.dim() > 0 else first
    if isinstance(first, dict):
        return {k: _concat([c[k] for c in chunks]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([c[i] for c in chunks]) for i in range(len(first)))
    return first


def _to_cpu(out: Any) -> Any:
    return map_tensors(lambda t: t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu(), out)


def collect_outputs(state: BuildState, samples: Sequence[Any]) -> Any:
    """Outputs of the built model on ``samples``, on the CPU, in sample order.

    The samples are batched at the trial's batch size, the last batch padded to full size
    (one shape, so a compiled model does not recompile) and its padding sliced off.
    """
    from torch.utils.data import default_collate

    device = torch.device(state.device)
    size = state.batch_size
    chunks = []
    with settings_active(state.settings), torch.inference_mode():
        for start in range(0, len(samples), size):
            part = samples[start : start + size]
            batch = pad_batch(default_collate(list(part)), size)
            out = call_model(state.model, to_device(batch, device))
            chunks.append(_to_cpu(slice_batch(out, len(part))))
    return _concat(chunks)


def check_finite(outputs: Any) -> None:
    """Raise ``TrialError('nan')`` when an output holds NaN or infinity."""
    for i, leaf in enumerate(_leaves(outputs)):
        if leaf.is_floating_point() and not torch.isfinite(leaf).all():
            bad = int((~torch.isfinite(leaf)).sum())
            raise TrialError("nan", f"output {i} holds {bad} NaN/inf values out of {leaf.numel()}")


def fidelity(outputs: Any, reference: Any, kinds: Sequence[str] | None = None, mask: Any = None) -> float:
    """How closely ``outputs`` follow the baseline's, in [0, 1] (1 = identical): the score of
    the worst output tensor, each judged by its kind (see :mod:`autotune._fidelity`).

    Args:
        outputs: A candidate's outputs on the validation samples.
        reference: The baseline's outputs, same structure.
        kinds: ``"logits"``, ``"embedding"`` or ``"integer"`` per output tensor; ``None``
            judges every floating output as an embedding (logits need evidence or a declaration).
        mask: The samples' ``attention_mask`` ``(n, seq)``: token-level outputs are judged on real
            positions only.

    Example:
        >>> ref = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
        >>> fidelity(ref.flip(1), ref, ["logits"])
        0.0
    """
    return min((leaf["score"] for leaf in fidelity_report(outputs, reference, kinds, mask)), default=1.0)


@dataclasses.dataclass
class Reference:
    """The baseline's outputs on the validation samples, and its metric.

    Attributes:
        samples: The validation samples (uncollated, in a fixed order).
        chunk: Samples per metric batch (the baseline batch size).
        outputs: Baseline outputs on ``samples``, concatenated, on the CPU.
        metric: The baseline's metric (1.0 for fidelity).
        kinds: The kind of each output tensor, as fidelity judges it.
        mask: The samples' ``attention_mask`` or ``None``.
    """

    samples: list[Any]
    chunk: int
    outputs: Any
    metric: float
    kinds: list[str] | None = None
    mask: Any = None


def evaluate(
    outputs: Any,
    samples: Sequence[Any],
    chunk: int,
    device: str,
    metric: Callable[[Any, Any], float] | None,
    reference: Any | None,
    kinds: Sequence[str] | None = None,
    mask: Any = None,
) -> float:
    """The metric of ``outputs``: the user's metric over fixed batches, each weighted by its
    size (a short last batch counts as its samples, not as a whole batch), or fidelity to
    ``reference`` judged with ``kinds`` and ``mask`` (see :func:`fidelity`)."""
    from torch.utils.data import default_collate

    if metric is None:
        return 1.0 if reference is None else fidelity(outputs, reference, kinds, mask)
    values, sizes = [], []
    for start in range(0, len(samples), chunk):
        part = list(samples[start : start + chunk])
        batch = to_device(default_collate(part), torch.device(device))
        out = to_device(slice_batch(outputs, start + len(part), start), torch.device(device))
        try:
            value = float(metric(out, batch))
        except Exception as exc:
            raise TrialError("error", f"metric(outputs, batch) raised {type(exc).__name__}: {exc}") from exc
        values.append(value)
        sizes.append(len(part))
    return sum(v * n for v, n in zip(values, sizes, strict=True)) / sum(sizes)


def make_reference(
    state: BuildState,
    samples: list[Any],
    metric: Callable[[Any, Any], float] | None,
    output_kind: Any = "auto",
    loss_fn: Any = None,
) -> Reference:
    """Run the baseline on the validation samples, score it and tell the kind of each output."""
    outputs = collect_outputs(state, samples)
    try:
        check_finite(outputs)
    except TrialError as exc:
        raise InputError(
            f"The model's own (baseline) outputs are not finite: {exc}. Fix the model or its inputs."
        ) from None
    try:
        value = evaluate(outputs, samples, state.batch_size, state.device, metric, None)
    except TrialError as exc:
        raise InputError(f"Your metric failed on the baseline's outputs: {exc}") from None
    if value != value:  # NaN
        raise InputError("Your metric returned NaN on the baseline's outputs; it must return a number.")
    kinds = infer_kinds(outputs, samples, output_kind, loss_fn)
    return Reference(
        samples=samples,
        chunk=state.batch_size,
        outputs=outputs,
        metric=value,
        kinds=kinds,
        mask=attention_mask(samples),
    )
