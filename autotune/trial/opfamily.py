"""Operators by family, and the compact summary of one profiled window.

A profiler names operators as the framework runs them: ``aten::addmm`` and ``aten::softmax``
in PyTorch, ``MatMul`` and ``LayerNormalization`` in ONNX Runtime. Grouping them into a few
families (:data:`FAMILIES`) makes two pipelines comparable even when one of them runs through
another framework, or fused operators replace plain ones. No torch here: the summary is plain
data, built from rows the profiler module reads out of either profiler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["FAMILIES", "STAGES", "TRAIN_STAGES", "op_family", "summarize"]

FAMILIES = (
    "matmul/linear",
    "conv",
    "attention",
    "normalisation",
    "elementwise",
    "data movement",
    "quantize/dequantize",
    "other",
)
# The record_function ranges of one inference step and of one training step, in order.
STAGES = ("loader_wait", "host_to_device", "forward", "output_sync")
TRAIN_STAGES = ("loader_wait", "host_to_device", "forward", "backward", "optimizer_step")

_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "einsum", "dot", "mv", "addmv", "gemm", "linear"}
_MOVEMENT = {
    "copy", "to", "_to_copy", "contiguous", "clone", "cat", "concat", "stack", "view", "reshape", "permute",
    "transpose", "t", "expand", "index_select", "embedding", "gather", "index", "slice", "select", "narrow",
    "split", "chunk", "pad", "constant_pad_nd", "flatten", "unsqueeze", "squeeze", "as_strided", "empty",
    "empty_strided", "zeros", "fill", "zero", "pin_memory", "_pin_memory", "cast", "shape", "identity",
    "memcpy", "memset", "unfold", "repeat", "tile", "unbind", "_unsafe_view", "resize", "set", "detach",
}  # fmt: skip
_ELEMENTWISE = {
    "add", "mul", "sub", "div", "relu", "gelu", "silu", "tanh", "sigmoid", "exp", "log", "pow", "sqrt", "rsqrt",
    "neg", "where", "clamp", "clamp_min", "threshold", "hardtanh", "dropout", "erf", "abs", "max", "min", "mean",
    "sum", "softplus", "leaky_relu", "elu", "fastgelu", "biasgelu", "addcmul", "addcdiv", "lerp", "sign", "eq",
    "ne", "lt", "gt", "le", "ge", "masked_fill", "reciprocal", "amax", "argmax", "maximum", "minimum",
    "hardswish", "mish", "reducemean", "reducesum", "reducemax", "_foreach_add", "_foreach_mul",
    "_foreach_addcmul", "_foreach_addcdiv", "_foreach_sqrt", "_foreach_div", "_foreach_lerp", "mse_loss",
    "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss_backward", "log_softmax", "_log_softmax",
    "gelu_backward", "threshold_backward", "sigmoid_backward", "tanh_backward", "maxpool", "max_pool2d",
    "avg_pool2d", "adaptive_avg_pool2d", "globalaveragepool", "averagepool", "max_pool2d_with_indices",
}  # fmt: skip


def _base(name: str) -> str:
    """``aten::add_`` -> ``add``; ``MatMul`` -> ``matmul``; a CUDA ``Memcpy HtoD`` -> ``memcpy``."""
    base = name.split("::")[-1].strip().lower().split(" ")[0]
    return base.rstrip("_") or base


def op_family(name: str) -> str:
    """The family (one of :data:`FAMILIES`) of a PyTorch operator or ONNX Runtime node type.

    Example:
        >>> [op_family(n) for n in ("aten::addmm", "aten::_softmax", "MatMulInteger", "aten::copy_")]
        ['matmul/linear', 'attention', 'matmul/linear', 'data movement']
        >>> [op_family(n) for n in ("DequantizeLinear", "aten::native_layer_norm", "aten::gelu", "aten::foo")]
        ['quantize/dequantize', 'normalisation', 'elementwise', 'other']
    """
    base = _base(name)
    if "quantiz" in base:
        return "quantize/dequantize"
    if "attention" in base or ("softmax" in base and "log_softmax" not in base) or "flash" in base or "sdpa" in base:
        return "attention"
    if base in _MATMUL or "matmul" in base or "gemm" in base or "linear" in base or base.endswith("_mm"):
        return "matmul/linear"
    if "conv" in base:
        return "conv"
    if "norm" in base:
        return "normalisation"
    if base in _MOVEMENT or "memcpy" in base or base.startswith("_to_"):
        return "data movement"
    if base in _ELEMENTWISE or (base.endswith("_backward") and base.split("_")[0] in _ELEMENTWISE):
        return "elementwise"
    return "other"


def summarize(
    ops: Iterable[Mapping[str, Any]],
    stages_us: Mapping[str, float],
    *,
    n_steps: int,
    n_samples: int,
    top: int = 15,
) -> dict[str, Any]:
    """The compact summary of one profiled window.

    Args:
        ops: One row per operator: ``name``, ``self_us``, ``calls``, ``input_shapes``.
        stages_us: Microseconds spent in each stage's range over the window.
        n_steps: Profiled steps (batches, or optimizer steps in training).
        n_samples: Samples those steps processed.
        top: Operators listed by name; the rest still count in the families.

    Returns:
        ``stages`` and ``families`` as ``{name: {"ms", "share"}}`` (stage shares of the window,
        family shares of the operators' time), ``operators`` (the ``top`` by self time: ``name``,
        ``family``, ``self_ms``, ``share``, ``calls``, ``input_shapes``), ``op_ms``, ``window_ms``,
        ``n_steps``, ``n_samples``.

    Example:
        >>> s = summarize([{"name": "aten::addmm", "self_us": 750.0, "calls": 3, "input_shapes": "[[8], [4, 8]]"},
        ...                {"name": "aten::relu", "self_us": 250.0, "calls": 3, "input_shapes": ""}],
        ...               {"forward": 1500.0, "loader_wait": 500.0}, n_steps=3, n_samples=96)
        >>> s["operators"][0]["share"], s["families"]["matmul/linear"]["share"], s["stages"]["forward"]["share"]
        (0.75, 0.75, 0.75)
    """
    rows = sorted((dict(o) for o in ops if o.get("self_us", 0) > 0), key=lambda o: -o["self_us"])
    op_us = sum(o["self_us"] for o in rows)
    window_us = sum(stages_us.values())
    families = dict.fromkeys(FAMILIES, 0.0)
    for o in rows:
        families[op_family(o["name"])] += o["self_us"]
    return {
        "stages": {k: {"ms": v / 1e3, "share": v / window_us if window_us else 0.0} for k, v in stages_us.items()},
        "families": {k: {"ms": v / 1e3, "share": v / op_us if op_us else 0.0} for k, v in families.items()},
        "operators": [
            {
                "name": o["name"],
                "family": op_family(o["name"]),
                "self_ms": o["self_us"] / 1e3,
                "share": o["self_us"] / op_us,
                "calls": int(o.get("calls", 0)),
                "input_shapes": str(o.get("input_shapes") or ""),
            }
            for o in rows[:top]
        ],
        "op_ms": op_us / 1e3,
        "window_ms": window_us / 1e3,
        "n_steps": n_steps,
        "n_samples": n_samples,
    }
