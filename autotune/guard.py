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

from .build import BuildState, settings_active
from .data import map_tensors, pad_batch, slice_batch, to_device
from .errors import InputError, TrialError
from .measure import call_model

__all__ = ["Reference", "collect_outputs", "fidelity", "evaluate"]


def _leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _leaves(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _leaves(v)]
    if hasattr(out, "to_tuple"):  # model-output dataclasses
        return _leaves(out.to_tuple())
    return []


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


def fidelity(outputs: Any, reference: Any) -> float:
    """How closely ``outputs`` follow the baseline's, in [0, 1] (1 = identical).

    Classification logits (2-D, several classes) score their top-1 agreement; other floating
    outputs score ``1 - min(1, relative L2 error)``; integer outputs their exact agreement. The
    score is the mean over output tensors.
    """
    outs, refs = _leaves(outputs), _leaves(reference)
    if len(outs) != len(refs):
        return 0.0  # the output structure itself changed
    scores = []
    for out, ref in zip(outs, refs, strict=True):
        if out.shape != ref.shape:
            scores.append(0.0)
        elif ref.is_floating_point() and ref.dim() == 2 and ref.shape[-1] > 1:
            scores.append(float((out.argmax(-1) == ref.argmax(-1)).float().mean()))
        elif ref.is_floating_point():
            err = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-12))
            scores.append(1.0 - min(1.0, err))
        else:
            scores.append(float((out == ref).float().mean()) if ref.numel() else 1.0)
    return sum(scores) / len(scores) if scores else 1.0


@dataclasses.dataclass
class Reference:
    """The baseline's outputs on the validation samples, and its metric.

    Attributes:
        samples: The validation samples (uncollated, in a fixed order).
        chunk: Samples per metric batch (the baseline batch size).
        outputs: Baseline outputs on ``samples``, concatenated, on the CPU.
        metric: The baseline's metric (1.0 for fidelity).
    """

    samples: list[Any]
    chunk: int
    outputs: Any
    metric: float


def evaluate(
    outputs: Any,
    samples: Sequence[Any],
    chunk: int,
    device: str,
    metric: Callable[[Any, Any], float] | None,
    reference: Any | None,
) -> float:
    """The metric of ``outputs``: the user's metric over fixed batches, each weighted by its
    size (a short last batch counts as its samples, not as a whole batch), or fidelity."""
    from torch.utils.data import default_collate

    if metric is None:
        return 1.0 if reference is None else fidelity(outputs, reference)
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


def make_reference(state: BuildState, samples: list[Any], metric: Callable[[Any, Any], float] | None) -> Reference:
    """Run the baseline on the validation samples and score it."""
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
    return Reference(samples=samples, chunk=state.batch_size, outputs=outputs, metric=value)
