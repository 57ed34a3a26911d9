"""Process-wide state that one candidate can leave behind for the next, snapshot and restored.

A worker measures many configurations in one process. Thread counts, cuDNN and TF32 flags,
the quantized engine, the multi-head-attention fast path, denormal flushing and the inductor
and Dynamo configs are global: a knob that sets them, or a library that changes them as a side
effect (torchao's ``quantize_`` tunes inductor by default), would otherwise change how every
later candidate runs, the baseline included. :func:`snapshot` records the state as the worker
found it (stock PyTorch, before any knob ran); :func:`restore` puts it back before every
build and every measurement, and the candidate's own settings are applied on top of it.

What cannot be put back (the inter-op thread pool, once started) is never changed by a knob.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["State", "precision", "restore", "set_precision", "set_tf32", "snapshot", "tf32_on"]

# The float32 precision settings of torch >= 2.9, by backend and operation (``""`` is the
# generic one). Since 2.9, writing these and then reading or writing the legacy flags
# (``allow_tf32``, ``set_float32_matmul_precision``), as newer inductor and transformers do, raises
# a RuntimeError: where torch has them, they are the only ones read or written here.
PRECISIONS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv")


def _backend(path: str) -> Any:
    found: Any = torch.backends
    for part in filter(None, path.split(".")):
        found = getattr(found, part, None)
    return found if hasattr(found, "fp32_precision") else None


def _new_api() -> bool:
    return _backend("cuda.matmul") is not None and _backend("cudnn.conv") is not None


def precision() -> dict[str, Any]:
    """The float32 precision settings: by backend where torch has ``fp32_precision``, else the
    legacy flags."""
    if _new_api():
        return {path: _backend(path).fp32_precision for path in PRECISIONS if _backend(path) is not None}
    return {
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
    }


def set_precision(saved: dict[str, Any]) -> None:
    """Put back settings :func:`precision` read (the generic setting first: the others inherit it)."""
    if "matmul_precision" in saved:
        # The precision first: setting it also sets the CUDA matmul TF32 flag, set right after.
        torch.set_float32_matmul_precision(saved["matmul_precision"])
        torch.backends.cuda.matmul.allow_tf32 = saved["cuda_matmul_allow_tf32"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_allow_tf32"]
        return
    for path, value in saved.items():
        backend = _backend(path)
        if backend is not None and backend.fp32_precision != value:
            backend.fp32_precision = value


def set_tf32() -> None:
    """TF32 tensor-core math for float32 matmuls (cuBLAS) and convolutions (cuDNN), through the
    API this torch has."""
    if _new_api():
        _backend("cuda.matmul").fp32_precision = "tf32"
        _backend("cudnn.conv").fp32_precision = "tf32"
    else:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


def tf32_on() -> bool:
    """Whether float32 matmuls on CUDA may use TF32 (what :func:`set_tf32` turns on)."""
    if _new_api():
        return _backend("cuda.matmul").fp32_precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


@dataclasses.dataclass(frozen=True)
class State:
    """The process-wide settings a candidate could change."""

    num_threads: int
    cudnn_benchmark: bool
    precision: dict[str, Any]
    mha_fastpath: bool
    quantized_engine: str
    grad_enabled: bool
    inductor: dict[str, Any]
    dynamo: dict[str, Any]

    def differences(self, other: State) -> list[str]:
        """Names of the settings that differ between ``self`` and ``other`` (configs by key)."""
        out = [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ("inductor", "dynamo") and getattr(self, f.name) != getattr(other, f.name)
        ]
        for name in ("inductor", "dynamo"):
            mine, theirs = getattr(self, name), getattr(other, name)
            out += [f"{name}.{k}" for k in mine if _comparable(mine[k]) and mine[k] != theirs.get(k)]
        return out


def _comparable(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str, type(None)))


def _configs() -> tuple[Any, Any]:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    return inductor_config, dynamo_config


def snapshot() -> State:
    """The current process-wide settings."""
    inductor_config, dynamo_config = _configs()
    return State(
        num_threads=torch.get_num_threads(),
        cudnn_benchmark=torch.backends.cudnn.benchmark,
        precision=precision(),
        mha_fastpath=torch.backends.mha.get_fastpath_enabled(),
        quantized_engine=torch.backends.quantized.engine,
        grad_enabled=torch.is_grad_enabled(),
        inductor=inductor_config.get_config_copy(),
        dynamo=dynamo_config.get_config_copy(),
    )


def _load_changed(module: Any, saved: dict[str, Any]) -> None:
    # Loading only what changed keeps this cheap (hundreds of entries, few ever touched).
    current = module.get_config_copy()
    changed = {k: v for k, v in saved.items() if k in current and current[k] is not v and current[k] != v}
    if changed:
        module.load_config(changed)


def restore(state: State) -> None:
    """Put every setting of ``state`` back; denormals are never flushed in stock PyTorch."""
    inductor_config, dynamo_config = _configs()
    if torch.get_num_threads() != state.num_threads:
        torch.set_num_threads(state.num_threads)
    set_precision(state.precision)
    torch.backends.cudnn.benchmark = state.cudnn_benchmark
    torch.backends.mha.set_fastpath_enabled(state.mha_fastpath)
    if torch.backends.quantized.engine != state.quantized_engine:
        torch.backends.quantized.engine = state.quantized_engine
    torch.set_grad_enabled(state.grad_enabled)
    torch.set_flush_denormal(False)
    _load_changed(inductor_config, state.inductor)
    _load_changed(dynamo_config, state.dynamo)
