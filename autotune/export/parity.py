"""Parity of an exported artifact with the model it was exported from, and the helpers the
exporters share: the exportable form of a model and its flat inputs, outputs flattened to
tensors and restored to their structure, errors in one line.

An artifact is checked on the same validation samples as the tuned model: both run on batches
of the tuned batch size, and the artifact's outputs are compared with the model's (max absolute
and relative L2 error) and, when a metric is given, scored with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from autotune.errors import AutotuneError, InputError
from autotune.samples import (
    call_model,
    concat_outputs,
    model_inputs,
    outputs_to_cpu,
    pad_batch,
    slice_batch,
    tensor_leaves,
    to_device,
)
from autotune.shapes import Batches, run_chunks

# Up a floor, kept: the guard's leaf judgement; moved down, trial/fidelity.py would be a re-export shim.
from autotune.trial.fidelity import evaluate, fidelity

__all__ = [
    "CompiledWith",
    "FrozenCompiled",
    "check_parity",
    "describe_error",
    "device_of",
    "exportable",
    "flat_inputs",
    "output_leaves",
    "quiet_warnings",
    "restore_like",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MAX_ERROR_CHARS = 400


def describe_error(exc: BaseException) -> str:
    """``exc`` in one line: the innermost cause's type and first line, or an autotune error's
    own message.

    Exporters wrap the real cause (an unsupported operator, a data-dependent branch) in several
    layers of advice; the innermost exception names it.

    Example:
        >>> try:
        ...     raise RuntimeError("outer") from ValueError("inner\\nmore")
        ... except RuntimeError as exc:
        ...     describe_error(exc)
        'ValueError: inner'
    """
    # autotune's own errors already say what failed and why, in one line.
    while exc.__cause__ is not None and not isinstance(exc, AutotuneError):
        exc = exc.__cause__
    text = _ANSI.sub("", str(exc)).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if len(first) > _MAX_ERROR_CHARS:  # some first lines carry a whole graph or class dump
        first = first[: _MAX_ERROR_CHARS - 3] + "..."
    if isinstance(exc, AutotuneError):
        return first or type(exc).__name__
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class CompiledWith(torch.nn.Module):
    """A compiled module whose calls run with some of the compiler's process-wide settings
    changed, for its compiles and no one else's: dynamo and inductor read them while they trace,
    at the first call and at every recompile, so they are set around each call.

    ``fixed_floats``: the model's Python floats (a LayerNorm's eps, a scale kept as an attribute)
    are constants of the graph, not symbols. With symbolic shapes (``dynamic=True``) torch makes
    them symbols, then finds they cannot become tensors and traces the whole model again: on real
    all-MiniLM-L6-v2 over 2 cores that second trace took the first compile from 52 to 64 s, and a
    compile from the cache from 10 to 26 s. A float that changes between calls recompiles."""

    def __init__(self, compiled: torch.nn.Module, *, freezing: bool = False, fixed_floats: bool = False) -> None:
        super().__init__()
        self.compiled = compiled
        self.freezing, self.fixed_floats = freezing, fixed_floats

    @property
    def _orig_mod(self) -> Any:  # what the compile wraps, as on torch.compile's own module
        return getattr(self.compiled, "_orig_mod", self.compiled)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        inductor = {"freezing": True} if self.freezing else {}
        dynamo = {"specialize_float": True} if self.fixed_floats else {}
        with inductor_config.patch(inductor), dynamo_config.patch(dynamo):
            return self.compiled(*args, **kwargs)


class FrozenCompiled(CompiledWith):
    """A compiled module whose calls run with inductor's weight freezing on, so that a statically
    quantized graph compiles to int8 kernels, without turning freezing on for anything else."""

    def __init__(self, compiled: torch.nn.Module, *, fixed_floats: bool = False) -> None:
        super().__init__(compiled, freezing=True, fixed_floats=fixed_floats)


def exportable(model: nn.Module) -> nn.Module:
    """``model`` in eval mode without its ``torch.compile`` and freezing wrappers, which
    exporters cannot trace through; autocast and channels-last (:class:`~autotune.trial.build.TunedModule`)
    stay."""
    model = getattr(model, "_orig_mod", model)
    model.eval()  # not chained: a PT2E graph's patched eval() returns None
    return model


def flat_inputs(example: Any) -> tuple[list[str], list[torch.Tensor], int]:
    """A batch's model inputs as (graph input names, tensors, number of positional inputs)."""
    args, kwargs = model_inputs(example)
    names = [f"input_{i}" for i in range(len(args))] + list(kwargs)
    tensors = [*args, *kwargs.values()]
    for name, value in zip(names, tensors, strict=True):
        if not isinstance(value, torch.Tensor):
            raise InputError(f"Model input {name!r} is a {type(value).__name__}; an exported graph takes tensors only.")
    return names, tensors, len(args)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Silence warnings inside the block."""
    # Tracer and exporter warnings (constant folding, TracerWarning) repeat for every model and
    # say nothing the parity check does not.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def output_leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output in a fixed order (dict values in insertion order)."""
    return tensor_leaves(out)


def restore_like(template: Any, leaves: Any) -> Any:
    """Put flat ``leaves`` (a tensor or a sequence of them) back in ``template``'s structure.

    An ONNX graph returns its outputs as a flat list; a metric written for the model expects the
    model's own structure (a dict of logits, say).

    Example:
        >>> t = torch.zeros(1)
        >>> restore_like({"a": t, "b": (t, t)}, [t + 1, t + 2, t + 3])["b"][1]
        tensor([3.])
    """
    flat = [leaves] if isinstance(leaves, torch.Tensor) else list(leaves)
    it = iter(flat)

    def fill(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return next(it)
        if isinstance(node, Mapping):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, (tuple, list)):
            return type(node)(fill(v) for v in node)
        if hasattr(node, "to_tuple"):
            return fill(node.to_tuple())
        return node

    return fill(template)


def device_of(module: nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (CPU for one with neither)."""
    tensor = next(iter(module.parameters()), None)
    if tensor is None:
        tensor = next(iter(module.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _run_batches(
    fn: Callable[..., Any], samples: list[Any], batch_size: int, device: torch.device, batching: Any = None
) -> Any:
    from torch.utils.data import default_collate

    if batching is not None:
        return _run_per_sample(fn, samples, batch_size, device, batching)
    chunks = []
    with torch.inference_mode():
        for start in range(0, len(samples), batch_size):
            part = list(samples[start : start + batch_size])
            # Padded to a full batch: an artifact traced or exported at one batch size sees only it.
            batch = to_device(pad_batch(default_collate(part), batch_size), device)
            chunks.append(outputs_to_cpu(slice_batch(call_model(fn, batch), len(part))))
    return concat_outputs(chunks)


def _run_per_sample(
    fn: Callable[..., Any], samples: list[Any], batch_size: int, device: torch.device, batching: Any
) -> Any:
    """Token sequences: batched as the winner batches them (its padding and length grouping, so
    the artifact sees several lengths), each sample's output cut to its real tokens, joined in
    sample order (see :func:`autotune.trial.guard.collect_per_sample`)."""
    from autotune.batching import lengths_of
    from autotune.batching.outputs import join_samples, split_samples

    pieces: list[Any] = [None] * len(samples)
    with torch.inference_mode():
        for ids, batch in batching.batches(samples, lengths_of(samples)):
            # Padded to a full batch: an artifact traced at one batch size sees only it.
            full = to_device(pad_batch(batch, batch_size), device)
            out = outputs_to_cpu(slice_batch(call_model(fn, full), len(ids)))
            for i, piece in zip(ids, split_samples(out, batch, batching.tokens), strict=False):
                pieces[i] = piece
    return join_samples(pieces)[0]


def _errors(outputs: Any, reference: Any) -> tuple[float, float, str | None]:
    """(max absolute error, the largest relative L2 error of any output, why they cannot be
    compared or ``None``).

    Each output's error is relative to its own scale (``||out - ref|| / ||ref||``), so a small
    output cannot hide behind a large one, and an output of tiny magnitude is not excused by an
    absolute tolerance: an all-zero artifact is 100% off whatever the scale.
    """
    outs, refs = output_leaves(outputs), output_leaves(reference)
    if len(outs) != len(refs):
        return math.inf, math.inf, f"the artifact returns {len(outs)} tensors, the model {len(refs)}"
    max_abs, worst = 0.0, 0.0
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        if out.shape != ref.shape:
            return math.inf, math.inf, f"output {i} has shape {list(out.shape)}, the model's {list(ref.shape)}"
        out, ref = out.double(), ref.double()
        if not torch.isfinite(out).all():
            return math.inf, math.inf, f"output {i} holds NaN/inf values"
        if out.numel():
            max_abs = max(max_abs, float((out - ref).abs().max()))
        err, scale = float(torch.linalg.vector_norm(out - ref)), float(torch.linalg.vector_norm(ref))
        worst = max(worst, 0.0 if err == 0 else err / max(scale, 1e-30))
    return max_abs, worst, None


def _finite(value: float | None) -> float | None:
    # JSON has no infinity or NaN; None says "not measurable".
    return value if value is not None and math.isfinite(value) else None


def check_parity(
    run: Callable[..., Any],
    reference: nn.Module,
    samples: list,
    batch_size: int,
    *,
    metric: Callable[[Any, Any], float] | None = None,
    baseline_metric: float | None = None,
    rtol_l2: float = 1e-2,
    max_metric_drop: float = 0.01,
    baseline_outputs: Any = None,
    kinds: list[str] | None = None,
    mask: Any = None,
    metric_chunk: int | None = None,
    batching: Any = None,
    memo: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run an artifact and its reference model on ``samples`` and compare their outputs.

    Args:
        run: The artifact, called like the model: ``run(*args, **kwargs)`` with a batch's model
            inputs (an :class:`~autotune.export.onnx.OrtModule`, a loaded TorchScript module).
        reference: The model the artifact was exported from; it runs on its own device, and
            ``run`` gets the batches on that device too.
        samples: Validation samples (uncollated).
        batch_size: Samples per batch.
        metric: ``metric(outputs, batch) -> float``, higher is better; ``None`` checks the
            outputs' errors alone.
        baseline_metric: The metric to compare with; ``None`` scores the reference's outputs.
        rtol_l2: The largest relative L2 error of any output against its own scale
            (``||out - ref|| / ||ref||``) that passes.
        max_metric_drop: The largest drop of the metric below ``baseline_metric`` (or, without
            a metric, of fidelity to ``baseline_outputs``) that passes.
        baseline_outputs: The untuned model's outputs on ``samples``: without a metric, the
            artifact must keep the guard's fidelity to them, so export drift cannot add to the
            drift the guard allowed the tuned model.
        kinds: The kind of each output, as the guard judges it (:func:`autotune.trial.guard.fidelity`).
        mask: The samples' ``attention_mask``, as the guard uses it.
        metric_chunk: Samples per metric batch: the guard's (the baseline batch size), so the
            metric sees the batches the baseline's metric saw; default ``batch_size``.
        batching: For token sequences, the winner's :class:`~autotune.batching.Batching`: the
            samples are batched as it batches them and compared sample by sample.
        memo: Where each reference's outputs are kept, by the reference, for the next artifact
            checked against it on the same samples (a winner's TorchScript and ONNX files are
            checked against one model: its outputs are computed once). The caller keeps the
            references alive while the memo is in use.

    Returns:
        ``{"max_abs", "rel_l2", "metric", "metric_drop", "fidelity", "baseline_fidelity", "ok",
        "reason"}``: ``rel_l2`` is the largest per-output relative error against the reference;
        ``fidelity`` the guard's fidelity to the reference's outputs and ``baseline_fidelity``
        to ``baseline_outputs``; ``ok`` holds when ``rel_l2 <= rtol_l2``, and the metric drop
        (or ``1 - baseline_fidelity``) is at most ``max_metric_drop``; ``reason`` says in one
        line why not (``None`` when ok). Unmeasurable numbers are ``None``.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> check_parity(model, model, [torch.randn(4)] * 3, 2)["ok"]
        True
    """
    device = device_of(reference)
    if isinstance(baseline_outputs, Batches):  # outputs that change shape: the guard's batches
        chunk, collate = baseline_outputs.chunk, None if batching is None else batching.collate_fn

        def run_all(fn: Any) -> Any:
            return run_chunks(fn, samples, chunk, batch_size, collate, device)

        batching = None if batching is None else dataclasses.replace(batching, tokens=())
    else:

        def run_all(fn: Any) -> Any:
            return _run_batches(fn, samples, batch_size, device, batching)

    expected = None if memo is None else memo.get(id(reference))
    if expected is None:
        was_training = reference.training
        if was_training:
            reference.eval()
        try:
            expected = run_all(reference)
        finally:
            if was_training:  # only then: a PT2E graph refuses train()
                reference.train()
        if memo is not None:
            memo[id(reference)] = expected
    result: dict[str, Any] = dict.fromkeys(
        ("max_abs", "rel_l2", "metric", "metric_drop", "fidelity", "baseline_fidelity")
    )
    try:
        outputs = run_all(run)
    except Exception as exc:  # any failure of the artifact is its verdict, not the caller's crash
        return {**result, "ok": False, "reason": f"the artifact raised {describe_error(exc)}"}
    max_abs, rel_l2, mismatch = _errors(outputs, expected)
    if mismatch is not None:
        return {**result, "max_abs": _finite(max_abs), "rel_l2": _finite(rel_l2), "ok": False, "reason": mismatch}
    result.update(max_abs=_finite(max_abs), rel_l2=_finite(rel_l2), fidelity=fidelity(outputs, expected, kinds, mask))
    reason = None
    if not rel_l2 <= rtol_l2:
        reason = f"an output differs from the model's by a relative L2 error of {rel_l2:.3g} > {rtol_l2:g}"
    if metric is None and baseline_outputs is not None:
        kept = fidelity(outputs, baseline_outputs, kinds, mask)
        result["baseline_fidelity"] = kept
        if reason is None and not 1.0 - kept <= max_metric_drop:
            reason = (
                f"against the untuned model the artifact's fidelity is {kept:.4g}, a drop of {1.0 - kept:.4g} "
                f"> {max_metric_drop:g}: export drift added to the tuned model's"
            )
    if metric is not None:
        chunk = metric_chunk or batch_size
        collate = None if batching is None else batching.collate_fn
        tokens = () if batching is None else batching.tokens
        value = evaluate(outputs, samples, chunk, str(device), metric, None, collate=collate, tokens=tokens)
        if baseline_metric is None:
            baseline_metric = evaluate(
                expected, samples, chunk, str(device), metric, None, collate=collate, tokens=tokens
            )
        drop = baseline_metric - value
        result.update(metric=_finite(value), metric_drop=_finite(drop))
        if reason is None and not drop <= max_metric_drop:  # `not <=` so that NaN fails too
            reason = (
                f"the metric drops by {drop:.4g} (from {baseline_metric:.4g} to {value:.4g}), "
                f"more than {max_metric_drop:g}"
            )
    return {**result, "ok": reason is None, "reason": reason}
