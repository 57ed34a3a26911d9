"""The accuracy guard: the user's metric, or fidelity to the baseline's outputs.

Every trial runs its tuned model on the same fixed validation samples. The outputs are
compared in chunks of the baseline batch size whatever the trial's own batch size, so the
metric of every trial averages over the same batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from autotune.batching import lengths_of, token_outputs
from autotune.batching.outputs import join_samples, split_samples
from autotune.errors import InputError, TrialError
from autotune.knobs.state import BuildState
from autotune.samples import (
    call_model,
    concat_outputs,
    outputs_to_cpu,
    pad_batch,
    slice_batch,
    tensor_leaves,
    to_device,
)
from autotune.shapes import Batches, pad_images, run_chunks, same_shapes
from autotune.trial.build import settings_active
from autotune.trial.fidelity import attention_mask, evaluate, fidelity, fidelity_report, infer_kinds

__all__ = ["Reference", "collect_outputs", "fidelity", "fidelity_report", "evaluate"]


def collect_outputs(state: BuildState, samples: Sequence[Any], baseline: bool = False) -> Any:
    """Outputs of the built model on ``samples``, on the CPU, in sample order.

    The samples are batched at the trial's batch size, the last batch padded to full size
    (one shape, so a compiled model does not recompile) and its padding sliced off. Token
    sequences go through :func:`collect_per_sample` instead.

    Outputs whose shape changes from batch to batch (images a collate pads to each batch's
    widest) cannot be joined: they come back as :class:`~autotune.shapes.Batches` over the
    metric's batches (the baseline batch size), which the baseline's outputs decide once for
    every configuration.
    """
    from torch.utils.data import default_collate

    if per_sample(state):
        return collect_per_sample(state, samples)[0]
    device = torch.device(state.device)
    size = state.batch_size
    ragged = 0 if state.extras is None else state.extras.ragged
    if ragged:
        # Images autotune pads: the configuration's own padding, dense maps cut back to the baseline's.
        own = state.extras.collate_fn is pad_images
        collate = state.batching().collate if own else _collate(state)
        with settings_active(state.settings):
            return run_chunks(state.model, samples, ragged, size, collate, device, crop=own)
    chunks = []
    with settings_active(state.settings), torch.inference_mode():
        for start in range(0, len(samples), size):
            part = samples[start : start + size]
            batch = pad_batch((_collate(state) or default_collate)(list(part)), size)
            out = call_model(state.model, to_device(batch, device))
            chunks.append(outputs_to_cpu(slice_batch(out, len(part))))
    if same_shapes(chunks):
        return concat_outputs(chunks)
    if not baseline or state.extras is None:
        raise TrialError("error", _changing_shapes(chunks, size))
    # The baseline, on the metric's own batches: from now on every configuration is compared on them.
    state.extras.ragged = size
    return Batches(chunks, chunk=size)


def _changing_shapes(chunks: Sequence[Any], size: int) -> str:
    first = [list(t.shape) for t in tensor_leaves(chunks[0])]
    shapes = ([list(t.shape) for t in tensor_leaves(c)] for c in chunks)
    other = next(s for s in shapes if s != first)
    return (
        f"the outputs change shape from batch to batch at batch size {size} ({first} then {other}) though "
        "not at the baseline's; give every sample one shape, or pass metric= to judge the outputs"
    )


def per_sample(state: BuildState) -> bool:
    """Whether the samples are token sequences, batched with the configuration's padding and
    grouping and compared sample by sample."""
    return state.extras is not None and state.extras.lengths is not None and not state.extras.images


def collect_per_sample(state: BuildState, samples: Sequence[Any]) -> tuple[Any, Any]:
    """Outputs on ``samples`` batched as the configuration batches them (its padding, its
    length grouping), each sample's output cut to its real tokens and put back in sample order,
    joined (token-level outputs zero-padded to the longest sample).

    Returns:
        ``(outputs, mask)``: the joined outputs and the ``(n, longest)`` mask of real positions
        (``None`` without token-level outputs); the same samples give the same mask in any
        configuration, so candidates and the baseline line up position by position.
    """
    device = torch.device(state.device)
    batching = state.batching(lengths_of(samples))
    pieces: list[Any] = [None] * len(samples)
    with settings_active(state.settings), torch.inference_mode():
        for ids, batch in batching.batches(samples):
            # A short batch is padded to full size and its outputs cut back: 225 validation
            # sentences in batches of 32 left one of 1, and a compile with shapes as symbols built
            # again for it (a size of 1 is never a symbol): 20 s of a guard a user never pays.
            full = pad_batch(batch, state.batch_size)
            out = outputs_to_cpu(slice_batch(call_model(state.model, to_device(full, device)), len(ids)))
            for i, piece in zip(ids, split_samples(out, batch, batching.tokens), strict=False):
                pieces[i] = piece
    return join_samples(pieces)


def check_finite(outputs: Any) -> None:
    """Raise ``TrialError('nan')`` when an output holds NaN or infinity."""
    for i, leaf in enumerate(tensor_leaves(outputs)):
        if leaf.is_floating_point() and not torch.isfinite(leaf).all():
            bad = int((~torch.isfinite(leaf)).sum())
            raise TrialError("nan", f"output {i} holds {bad} NaN/inf values out of {leaf.numel()}")


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

    def save(self, path: Path) -> bool:
        """Write all but the samples to ``path`` (beside it, then renamed: a reader never sees
        half a file) for the run's later workers, which hold the samples; ``False``, writing
        nothing, for outputs over :data:`STORED_REFERENCE_BYTES` or a write that failed (an
        optimization: the trial goes on)."""
        import os

        held = sum(t.numel() * t.element_size() for t in tensor_leaves([self.outputs, self.mask]))
        if held > STORED_REFERENCE_BYTES:
            return False
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        try:
            torch.save({k: getattr(self, k) for k in ("chunk", "outputs", "metric", "kinds", "mask")}, part)
            os.replace(part, path)
        except Exception:  # a full disk, outputs that do not pickle: later workers make their own
            part.unlink(missing_ok=True)
            return False
        return True

    @classmethod
    def load(cls, path: Path, samples: list[Any]) -> Reference | None:
        """The reference :meth:`save` wrote to ``path``, on ``samples``; ``None`` where there is none."""
        try:
            # The run's own file, in its private scratch folder: its outputs may be any structure.
            return cls(samples=samples, **torch.load(path, map_location="cpu", weights_only=False))
        except Exception:  # damaged or of another version: made again
            return None


# The largest outputs (and mask) a run stores for its later workers: outputs past it (masks of
# large images, say) cost more to write and read than to make again.
STORED_REFERENCE_BYTES = 256 << 20


def make_reference(
    state: BuildState,
    samples: list[Any],
    metric: Callable[[Any, Any], float] | None,
    output_kind: Any = "auto",
    loss_fn: Any = None,
) -> Reference:
    """Run the baseline on the validation samples, score it and tell the kind of each output."""
    mask = attention_mask(samples)
    extras = state.extras
    if extras is not None and extras.images and extras.collate_fn is pad_images:
        # Images autotune pads: every configuration is judged on the baseline's batches, its own
        # padding cut back, whether or not the baseline's batches happen to share one size.
        extras.ragged = state.batch_size
    if per_sample(state):
        _find_token_outputs(state, samples)
        outputs, mask = collect_per_sample(state, samples)
    else:
        outputs = collect_outputs(state, samples, baseline=True)
    try:
        check_finite(outputs)
    except TrialError as exc:
        raise InputError(
            f"The model's own (baseline) outputs are not finite: {exc}. Fix the model or its inputs."
        ) from None
    try:
        value = evaluate(
            outputs,
            samples,
            state.batch_size,
            state.device,
            metric,
            None,
            collate=_collate(state),
            tokens=_tokens(state),
        )
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
        mask=mask,
    )


def _collate(state: BuildState) -> Any:
    return None if state.extras is None else state.extras.collate_fn


def _tokens(state: BuildState) -> tuple[int, ...]:
    return () if state.extras is None else state.extras.token_outputs


def _find_token_outputs(state: BuildState, samples: Sequence[Any]) -> None:
    """Tell, on the baseline's first batch, which float ``(batch, seq)`` outputs hold one value per
    token (question answering's start and end logits), so every configuration cuts them to real
    tokens as it cuts ``(batch, seq, hidden)`` ones; the build extras carry the answer."""
    if state.extras is None or not samples:
        return
    batching = state.batching(lengths_of(samples))
    _, batch = next(batching.batches(samples))
    device = torch.device(state.device)
    with settings_active(state.settings), torch.inference_mode():
        found = token_outputs(lambda b: outputs_to_cpu(call_model(state.model, to_device(b, device))), batch)
    state.extras.token_outputs = found
