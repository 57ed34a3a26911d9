"""Fidelity of a candidate's outputs to the baseline's, judged per output by its kind.

Every output tensor (a *leaf* of the model's output structure) is judged by what it is, and the
worst leaf decides: one ruined output among many ruins the candidate.

- ``"logits"`` (classification scores, last axis = classes): the share of samples whose top-1
  class agrees with the baseline's (a flip between two classes whose baseline probabilities are
  within :data:`TIE` of each other is a tie, not a changed decision), and ``1 -`` the mean total
  variation distance between the two softmax distributions. The score is the smaller.
- ``"embedding"`` (every other floating output: embeddings, hidden states, regression values):
  judged about the baseline's mean over the samples, so a component all samples share (a
  regression head's offset, the massive activations of encoders) cannot hide damage to the part
  that tells the samples apart: the lowest cosine similarity of a sample's centred vectors, the
  change of the centred vectors' RMS length (``spread``: outputs pulled toward their mean keep
  every direction), and the mean relative change of each whole vector's length. The score is the
  smallest of the lowest cosine and ``1 -`` each change of length (the relative L2 error is
  reported too). Outputs with one value per sample (or per real token) score ``1 -``
  their L2 error over the L2 spread of the baseline's values about their mean.
- ``"integer"``: the share of exactly equal values.

Token-level outputs (``(batch, seq, ...)``, and float ``(batch, seq)`` ones such as question
answering's start and end logits, found on the baseline by
:func:`autotune.batching.token_outputs`) are judged on real positions only when the batch has an
``attention_mask`` input of shape ``(batch, seq)`` (1 = real token, 0 = padding); as logits, a
``(batch, seq)`` output scores positions, padding excluded.

Leaves are logits only when the user says so (``output_kind``) or the evidence is strong: a
cross-entropy ``loss_fn``, or integer targets (``(inputs, target)`` samples, or a ``labels`` /
``label`` key) whose classes index the leaf's last axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from autotune.errors import ConfigError, TrialError
from autotune.samples import slice_batch, tensor_leaves, to_device
from autotune.shapes import Batches

__all__ = [
    "KINDS",
    "TIE",
    "attention_mask",
    "check_output_kind",
    "evaluate",
    "fidelity",
    "fidelity_report",
    "infer_kinds",
    "leaf_names",
]

KINDS = ("auto", "logits", "embedding", "integer")
# Baseline probabilities closer than this are a tie: which of the two wins is noise, not a decision.
TIE = 0.01


_leaves = tensor_leaves  # the one definition of an output's tensors, in order


def leaf_names(out: Any, prefix: str = "") -> list[str]:
    """Names of the leaves in :func:`_leaves` order: dict keys, tuple indices, ``output``.

    Example:
        >>> t = torch.zeros(1)
        >>> leaf_names({"logits": t, "hidden": (t, t)})
        ['logits', 'hidden.0', 'hidden.1']
    """
    if isinstance(out, torch.Tensor):
        return [prefix or "output"]
    if isinstance(out, Mapping):
        items = list(out.items())
    elif isinstance(out, (tuple, list)):
        items = list(enumerate(out))
    else:
        return []
    return [n for k, v in items for n in leaf_names(v, f"{prefix}.{k}" if prefix else str(k))]


def check_output_kind(output_kind: Any) -> None:
    """Raise ``ConfigError`` unless ``output_kind`` is a kind, a sequence of kinds or a mapping
    from output names to kinds."""
    if isinstance(output_kind, str):
        values = [output_kind]
    elif isinstance(output_kind, Mapping):
        values = list(output_kind.values())
        if not all(isinstance(k, (str, int)) for k in output_kind):
            raise ConfigError("`output_kind` keys must be output names (dict keys) or indices.")
    elif isinstance(output_kind, Sequence):
        values = list(output_kind)
    else:
        raise ConfigError(
            f"`output_kind` must be one of {', '.join(KINDS)}, a list of them or a dict of them by output "
            f"name, but got {type(output_kind).__name__}."
        )
    bad = [v for v in values if v not in KINDS]
    if bad:
        raise ConfigError(f"No output kind {bad[0]!r}. Known: {', '.join(KINDS)}.")


def _targets(sample: Any) -> Any:
    """A sample's integer classification target, or ``None``."""
    target = None
    if isinstance(sample, Mapping):
        target = sample.get("labels", sample.get("label"))
    elif isinstance(sample, (tuple, list)) and len(sample) == 2:
        target = sample[1]
    if isinstance(target, int) and not isinstance(target, bool):
        return torch.tensor(target)
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.dtype != torch.bool:
        return target
    return None


def _is_cross_entropy(loss_fn: Any) -> bool:
    import torch.nn.functional as F

    return loss_fn is F.cross_entropy or isinstance(loss_fn, torch.nn.CrossEntropyLoss)


def infer_kinds(reference: Any, samples: Sequence[Any], output_kind: Any = "auto", loss_fn: Any = None) -> list[str]:
    """The kind of every leaf of the baseline's ``reference`` outputs on ``samples``.

    Args:
        reference: The baseline's outputs (concatenated over ``samples``).
        samples: The validation samples, uncollated.
        output_kind: ``"auto"``, a kind for every floating leaf, a list of kinds in leaf order,
            or a dict of kinds by leaf name (:func:`leaf_names`); leaves it does not name are
            ``"auto"``.
        loss_fn: The user's fine-tuning loss: cross-entropy is evidence of logits.

    Returns:
        One of ``"logits"``, ``"embedding"``, ``"integer"`` per leaf.
    """
    check_output_kind(output_kind)
    if isinstance(reference, Batches):  # outputs batch by batch: every batch has the same leaves
        reference = reference[0] if reference else ()
    leaves, names = _leaves(reference), leaf_names(reference)
    if isinstance(output_kind, str):
        asked = [output_kind] * len(leaves)
    elif isinstance(output_kind, Mapping):
        asked = [output_kind.get(n, output_kind.get(i, "auto")) for i, n in enumerate(names)]
    else:
        if len(output_kind) != len(leaves):
            raise ConfigError(
                f"`output_kind` lists {len(output_kind)} kinds, but the model returns {len(leaves)} tensors "
                f"({', '.join(names)}). List one per tensor, or pass a dict by name."
            )
        asked = list(output_kind)
    targets = [_targets(s) for s in samples]
    labels = None
    if targets and all(t is not None for t in targets):
        try:
            labels = torch.stack(targets)
        except RuntimeError:  # per-token labels of different lengths: no evidence of classes here
            labels = None
    kinds = []
    for leaf, kind in zip(leaves, asked, strict=True):
        if not leaf.is_floating_point():
            kinds.append("integer")
        elif kind != "auto":
            kinds.append(kind)
        else:
            kinds.append("logits" if _looks_like_logits(leaf, labels, loss_fn) else "embedding")
    return kinds


def _looks_like_logits(leaf: torch.Tensor, labels: torch.Tensor | None, loss_fn: Any) -> bool:
    if leaf.dim() < 2 or leaf.shape[-1] < 2:
        return False
    if _is_cross_entropy(loss_fn):
        return True
    if labels is None or tuple(labels.shape) != tuple(leaf.shape[:-1]):
        return False
    real = labels[labels >= 0]  # -100: positions a token classifier ignores
    return bool(real.numel()) and int(real.max()) < leaf.shape[-1]


def attention_mask(samples: Sequence[Any]) -> torch.Tensor | None:
    """The ``attention_mask`` model input of ``samples`` stacked to ``(n, seq)``, or ``None``."""
    from autotune.samples import model_inputs

    masks = []
    for sample in samples:
        _, kwargs = model_inputs(sample)
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor):
            return None
        masks.append(mask)
    try:
        return torch.stack(masks).bool() if masks else None
    except RuntimeError:  # unequal lengths: no mask that lines up with the outputs
        return None


def _rows(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None, keep_last: bool) -> tuple:
    """``(out, ref)`` as rows: one per sample, or one per real token under ``mask``."""
    if mask is not None and out.dim() >= 2 and tuple(out.shape[:2]) == tuple(mask.shape):
        out, ref = out[mask], ref[mask]  # (n real tokens, ...)
    if keep_last:
        return out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    return out.reshape(out.shape[0], -1), ref.reshape(ref.shape[0], -1)


def _judge_logits(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
    out, ref = out.double(), ref.double()
    if mask is not None and out.dim() == 2 and tuple(out.shape) == tuple(mask.shape):
        # Scores over positions (question answering's start logits): padding is no choice.
        out, ref = out.masked_fill(~mask, -1e300), ref.masked_fill(~mask, -1e300)
        mask = None
    out, ref = _rows(out, ref, mask, keep_last=True)
    p, q = out.softmax(-1), ref.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    top_out, top_ref = out.argmax(-1), ref.argmax(-1)
    gap = q.gather(-1, top_ref[:, None])[:, 0] - q.gather(-1, top_out[:, None])[:, 0]
    agree = (top_out == top_ref) | (gap <= TIE)
    top1 = float(agree.double().mean()) if agree.numel() else 1.0
    mean_tv = float(tv.mean()) if tv.numel() else 0.0
    return {
        "score": min(top1, 1.0 - mean_tv),
        "top1": top1,
        "tv_mean": mean_tv,
        "tv_max": float(tv.max()) if tv.numel() else 0.0,
    }


def _judge_values(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """One value per sample (or per real token): the L2 error over the spread of the reference
    about its mean, not over its magnitude, so a shared offset cannot hide damage to the part that
    tells the samples apart. A reference with no spread is judged against its magnitude."""
    size, spread = ref.norm(), (ref - ref.mean()).norm()
    scale = spread if spread > 1e-4 * size else size
    err = float((out - ref).norm() / scale.clamp_min(1e-12))
    return {"score": 1.0 - min(1.0, err), "rel_mean": err}


def _judge_embedding(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
    if ref.dim() == 0:  # one value for the whole output: a batch of one
        out, ref = out.reshape(1), ref.reshape(1)
    out, ref = _rows(out.double(), ref.double(), mask, keep_last=False)
    if ref.shape[1] == 1:  # one value per sample, or per real token under the mask
        return _judge_values(out[:, 0], ref[:, 0])
    norm_ref, norm_out = ref.norm(dim=-1), out.norm(dim=-1)
    # A row of zeros in both is identical; a floor keeps near-zero rows from dividing by nothing.
    floor = max(float(norm_ref.mean()) * 1e-6, 1e-12)
    # Vectors are judged about the baseline's mean vector: a component every sample shares (the
    # "massive activations" of transformer encoders, a regression head's offset) would otherwise
    # hold the cosine and the length near 1 while the part that tells samples apart is ruined.
    center = ref.mean(0, keepdim=True) if ref.shape[0] > 1 else torch.zeros_like(ref[:1])
    out_c, ref_c = out - center, ref - center
    n_ref, n_out = ref_c.norm(dim=-1), out_c.norm(dim=-1)
    cos = (out_c * ref_c).sum(-1) / (n_ref.clamp_min(floor) * n_out.clamp_min(floor))
    cos = torch.where((n_ref <= floor) & (n_out <= floor), torch.ones_like(cos), cos)
    rel = (out - ref).norm(dim=-1) / norm_ref.clamp_min(floor)
    # Length judged apart from direction: the RMS length of the centred vectors against the
    # baseline's (outputs pulled toward their mean keep every direction; random noise changes it
    # only to second order, so int8 and bfloat16 keep it), and the relative change of each whole
    # vector's length. A relative L2 error would mix length and direction and, at 1%, demand a
    # cosine of 0.99995, which no int8 or bfloat16 model keeps.
    typical = max(float(n_ref.square().mean().sqrt()), floor)
    spread = min(1.0, abs(float(n_out.square().mean().sqrt()) / typical - 1.0))
    scale = ((norm_out - norm_ref).abs() / norm_ref.clamp_min(floor)).clamp_max(1.0)
    cos_min, scale_mean = float(cos.min()), float(scale.mean())
    return {
        "score": max(0.0, min(cos_min, 1.0 - spread, 1.0 - scale_mean)),
        "cos_min": cos_min,
        "cos_mean": float(cos.mean()),
        "spread": spread,
        "scale_mean": scale_mean,
        "rel_mean": float(rel.mean()),
        "rel_max": float(rel.max()),
    }


def _judge_integer(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
    if mask is not None and out.dim() >= 2 and tuple(out.shape[:2]) == tuple(mask.shape):
        out, ref = out[mask], ref[mask]
    return {"score": float((out == ref).double().mean()) if ref.numel() else 1.0}


_JUDGES = {"logits": _judge_logits, "embedding": _judge_embedding, "integer": _judge_integer}


def fidelity_report(
    outputs: Any, reference: Any, kinds: Sequence[str] | None = None, mask: torch.Tensor | None = None
) -> list[dict[str, Any]]:
    """Every leaf of ``outputs`` judged against ``reference``'s by its kind.

    Args:
        outputs: A candidate's outputs on the validation samples.
        reference: The baseline's, same structure.
        kinds: One kind per leaf (:func:`infer_kinds`); ``None`` infers them with no evidence
            of logits (every floating leaf is an ``"embedding"``).
        mask: The validation samples' ``attention_mask`` (:func:`attention_mask`).

    Returns:
        One dict per leaf: ``name``, ``kind``, ``score`` in [0, 1] and the kind's figures
        (logits: ``top1``, ``tv_mean``, ``tv_max``; embedding: ``cos_min``, ``cos_mean``,
        ``spread``, ``scale_mean``, ``rel_mean``, ``rel_max``); a structure that changed is one leaf scoring 0.
    """
    if isinstance(reference, Batches):
        return _batches_report(outputs, reference, kinds)
    outs, refs, names = _leaves(outputs), _leaves(reference), leaf_names(reference)
    if len(outs) != len(refs):
        return [{"name": "structure", "kind": None, "score": 0.0}]
    if kinds is None:
        kinds = infer_kinds(reference, [])
    report = []
    for name, kind, out, ref in zip(names, kinds, outs, refs, strict=True):
        if out.shape != ref.shape:
            report.append({"name": name, "kind": kind, "score": 0.0})
            continue
        if out.is_floating_point() and not torch.isfinite(out).all():
            report.append({"name": name, "kind": kind, "score": 0.0})
            continue
        judged = _JUDGES[kind](out, ref, mask)
        judged["score"] = float(judged["score"]) if math.isfinite(judged["score"]) else 0.0
        report.append({"name": name, "kind": kind, **judged})
    return report


def _batches_report(outputs: Any, reference: Batches, kinds: Sequence[str] | None) -> list[dict[str, Any]]:
    """:func:`fidelity_report` of outputs kept batch by batch (:class:`~autotune.shapes.Batches`):
    each leaf's values over every batch, compared position by position on the same batches.
    Logits are judged per row of their last axis; other floating leaves as values (their L2
    error over the baseline's spread), since vectors of different lengths share no mean.

    Raises:
        TrialError: A leaf's shape differs from the baseline's on some batch (a detector's
            count of boxes, say): nothing lines the values up without the user's metric.
    """
    if not isinstance(outputs, Batches) or len(outputs) != len(reference):
        return [{"name": "structure", "kind": None, "score": 0.0}]
    per_batch = [(_leaves(o), _leaves(r)) for o, r in zip(outputs, reference, strict=True)]
    if any(len(o) != len(r) for o, r in per_batch):
        return [{"name": "structure", "kind": None, "score": 0.0}]
    names = leaf_names(reference[0])
    kinds = list(kinds) if kinds is not None else infer_kinds(reference, [])
    report = []
    for j, (name, kind) in enumerate(zip(names, kinds, strict=True)):
        pairs = [(o[j], r[j]) for o, r in per_batch]
        for k, (out, ref) in enumerate(pairs):
            if out.shape != ref.shape:
                raise TrialError(
                    "unsupported",
                    f"output {name!r} has shape {list(out.shape)} on validation batch {k}, the baseline's "
                    f"{list(ref.shape)}: outputs whose shapes change cannot be compared without a metric; "
                    "pass metric=... to judge them",
                )
        if any(o.is_floating_point() and not torch.isfinite(o).all() for o, _ in pairs):
            report.append({"name": name, "kind": kind, "score": 0.0})
            continue
        last = {r.shape[-1] for _, r in pairs if r.dim() >= 2}
        if kind == "logits" and len(last) == 1 and all(r.dim() >= 2 for _, r in pairs):
            width = last.pop()
            out, ref = (torch.cat([p[i].reshape(-1, width) for p in pairs]) for i in (0, 1))
            judged = _judge_logits(out, ref, None)
        else:
            out, ref = (torch.cat([p[i].reshape(-1) for p in pairs]) for i in (0, 1))
            if kind == "integer" or not ref.is_floating_point():
                judged = _judge_integer(out, ref, None)
            else:
                judged = _judge_values(out.double(), ref.double())
        judged["score"] = float(judged["score"]) if math.isfinite(judged["score"]) else 0.0
        report.append({"name": name, "kind": kind, **judged})
    return report


def fidelity(outputs: Any, reference: Any, kinds: Sequence[str] | None = None, mask: Any = None) -> float:
    """How closely ``outputs`` follow the baseline's, in [0, 1] (1 = identical): the score of
    the worst output tensor, each judged by its kind (see :mod:`autotune.trial.fidelity`).

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


def evaluate(
    outputs: Any,
    samples: Sequence[Any],
    chunk: int,
    device: str,
    metric: Callable[[Any, Any], float] | None,
    reference: Any | None,
    kinds: Sequence[str] | None = None,
    mask: Any = None,
    collate: Callable[[list[Any]], Any] | None = None,
    tokens: Sequence[int] = (),
) -> float:
    """The metric of ``outputs``: the user's metric over fixed batches, each weighted by its
    size (a short last batch counts as its samples, not as a whole batch), or fidelity to
    ``reference`` judged with ``kinds`` and ``mask`` (see :func:`fidelity`). ``collate`` makes
    the metric's batches (default ``default_collate``); token-level outputs (with the float
    ``(batch, seq)`` ones listed in ``tokens``) are fitted to each batch's width, zero-padded
    where the batch is wider than the real tokens, so the metric gets outputs aligned with the
    batch it is given."""
    from torch.utils.data import default_collate

    from autotune.batching import fit_width
    from autotune.samples import MASK_KEY, sample_inputs

    if metric is None:
        return 1.0 if reference is None else fidelity(outputs, reference, kinds, mask)
    values, sizes = [], []
    batched = isinstance(outputs, Batches)  # already one output per batch of `outputs.chunk` samples
    chunk = outputs.chunk if batched else chunk
    for k, start in enumerate(range(0, len(samples), chunk)):
        part = list(samples[start : start + chunk])
        batch = to_device((collate or default_collate)(part), torch.device(device))
        out = outputs[k] if batched else slice_batch(outputs, start + len(part), start)
        batch_mask = (sample_inputs(batch) or {}).get(MASK_KEY)
        if isinstance(batch_mask, torch.Tensor) and batch_mask.dim() == 2:
            out = fit_width(out, batch_mask.shape[1], out, tokens)
        out = to_device(out, torch.device(device))
        try:
            value = float(metric(out, batch))
        except Exception as exc:
            raise TrialError("error", f"metric(outputs, batch) raised {type(exc).__name__}: {exc}") from exc
        values.append(value)
        sizes.append(len(part))
    return sum(v * n for v, n in zip(values, sizes, strict=True)) / sum(sizes)
