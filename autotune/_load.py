"""Load an exported artifact of a tuning run and run it like a function: :func:`load`.

Example:
    >>> predict = load("autotune_out")  # doctest: +SKIP
    >>> predict(images).shape  # numpy in, numpy out  # doctest: +SKIP
    (1000, 10)
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import map_tensors, pad_batch, slice_batch
from .errors import ConfigError, InputError
from .export import FORMATS
from .guard import _concat

__all__ = ["Predictor", "load"]


class Predictor:
    """An exported artifact behind a plain call: arrays or tensors in, the same kind out.

    Inputs run in chunks of the tuned batch size (the last one padded to it, as the artifact
    was checked), and the outputs are concatenated.

    Attributes:
        format: ``"onnx"`` or ``"torchscript"``.
        path: The artifact file.
        batch_size: Samples per chunk.
        device: Where the artifact runs.
        input_names: The artifact's inputs, in positional order.
        record: The artifact's entry in ``best_config.json``.
    """

    def __init__(self, module: Any, fmt: str, path: Path, record: dict[str, Any], batch_size: int, device: str) -> None:
        self.module = module
        self.format = fmt
        self.path = path
        self.record = record
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.input_names: list[str] = list(record["input_names"])

    def __repr__(self) -> str:
        return f"Predictor(format={self.format!r}, path={str(self.path)!r}, batch_size={self.batch_size}, device={str(self.device)!r})"

    def _positional(self, inputs: Any) -> list[Any]:
        if isinstance(inputs, (np.ndarray, torch.Tensor)):
            return [inputs]
        if isinstance(inputs, (tuple, list)):
            return list(inputs)
        if isinstance(inputs, Mapping):
            missing = [n for n in self.input_names if n not in inputs]
            if missing:
                raise InputError(
                    f"Inputs lack {', '.join(map(repr, missing))}. The artifact takes: {', '.join(self.input_names)}."
                )
            return [inputs[n] for n in self.input_names]
        raise InputError(
            f"Inputs must be a numpy array or torch tensor, or a tuple/dict of them, but got {type(inputs).__name__}."
        )

    def __call__(self, inputs: Any) -> Any:
        """Run ``inputs`` (a batch: an array/tensor, a tuple of them by position, or a dict of
        them by input name); numpy in gives numpy out, torch in gives torch out (on the inputs'
        device)."""
        values = self._positional(inputs)
        as_numpy = any(isinstance(v, np.ndarray) for v in values)
        home = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
        tensors = [(torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for v in values]
        if not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors):
            raise InputError("Every input must be an array or tensor with a batch axis.")
        sizes = {int(t.shape[0]) for t in tensors}
        if len(sizes) != 1 or 0 in sizes:
            raise InputError(f"Inputs must share one non-zero batch size, but have {sorted(sizes)}.")
        n = sizes.pop()
        chunks = []
        with torch.inference_mode():
            for start in range(0, n, self.batch_size):
                part = [t[start : start + self.batch_size].to(self.device) for t in tensors]
                size = int(part[0].shape[0])
                chunks.append(slice_batch(self.module(*pad_batch(part, self.batch_size)), size))
        out = map_tensors(lambda t: t.to(home), _concat(chunks))
        return map_tensors(lambda t: t.numpy(), out) if as_numpy else out


def _read_artifacts(out_dir: Path) -> tuple[dict[str, Any], int | None]:
    """The ``artifacts`` entry of ``best_config.json`` and the run's batch size."""
    if not out_dir.is_dir():
        raise ConfigError(f"No directory {str(out_dir)!r}: give the out_dir that autotune.optimize wrote.")
    path = out_dir / "best_config.json"
    if not path.is_file():
        raise ConfigError(f"No best_config.json in {str(out_dir)!r}: give the out_dir that autotune.optimize wrote.")
    try:
        best = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"Cannot read {str(path)!r}: {exc}") from None
    artifacts = best.get("artifacts") if isinstance(best, dict) else None
    if not isinstance(artifacts, dict) or not artifacts:
        raise ConfigError(f"{str(path)!r} lists no artifacts: run the tuning with export formats to write them.")
    batch_size = (best.get("best") or {}).get("batch_size") or (best.get("config") or {}).get("batch_size")
    return artifacts, batch_size


def _choose(artifacts: dict[str, Any], fmt: str | None, where: Path) -> tuple[str, dict[str, Any]]:
    if fmt is not None:
        if fmt not in FORMATS:
            raise ConfigError(f"No artifact format named {fmt!r}. Known: {', '.join(FORMATS)}.")
        if fmt not in artifacts:
            raise ConfigError(f"{str(where)!r} has no {fmt} artifact. It has: {', '.join(artifacts)}.")
        if artifacts[fmt].get("status") != "ok":
            error = artifacts[fmt].get("error") or "no reason recorded"
            warnings.warn(f"Loading the {fmt} artifact although it failed its checks: {error}", stacklevel=3)
        return fmt, artifacts[fmt]
    for name in FORMATS:  # ONNX first: it runs without Python's model code or torch
        if (artifacts.get(name) or {}).get("status") == "ok":
            return name, artifacts[name]
    failed = "; ".join(f"{k}: {(v or {}).get('error') or 'failed'}" for k, v in artifacts.items())
    raise ConfigError(
        f"No artifact in {str(where)!r} passed its checks ({failed}). Pass format='onnx' or "
        "format='torchscript' to load one anyway."
    )


def _open(fmt: str, path: Path, record: dict[str, Any], device: str) -> Any:
    on_cuda = torch.device(device).type == "cuda"
    if fmt == "torchscript":
        return torch.jit.load(str(path), map_location=device)
    from .export.onnx import OrtModule

    ort = record.get("ort") or {}
    provider = ort.get("provider") or ""
    if ("CUDA" in provider or "Tensorrt" in provider) != on_cuda:  # recorded for another device
        provider = "CUDAExecutionProvider" if on_cuda else "CPUExecutionProvider"
    return OrtModule(
        path,
        record["input_names"],
        record.get("output_names") or [],
        provider=provider,
        graph_optimization=ort.get("graph_optimization", "all"),
        intra_op_threads=ort.get("intra_op_threads", 0),
        io_binding=on_cuda,
    )


def load(out_dir: str | Path, *, format: str | None = None, device: str = "cpu") -> Predictor:
    """Load the exported artifact of a tuning run from ``out_dir``.

    Args:
        out_dir: The run's directory, holding ``best_config.json`` and the artifact files.
        format: ``"onnx"`` or ``"torchscript"``; ``None`` takes the first that passed its checks,
            ONNX first. An artifact that failed its checks loads only when named here, with a warning.
        device: ``"cpu"`` or ``"cuda[:N]"``: ONNX runs on the matching ONNX Runtime provider.

    Returns:
        A :class:`Predictor`.

    Raises:
        ConfigError: no such directory, no ``best_config.json``, no artifacts, an unknown format,
            no artifact that passed its checks, or the artifact's file is missing.
    """
    out_dir = Path(out_dir)
    artifacts, run_batch_size = _read_artifacts(out_dir)
    fmt, record = _choose(artifacts, format, out_dir)
    path = out_dir / str(record.get("path") or "")
    if not record.get("path") or not path.is_file():
        raise ConfigError(f"The {fmt} artifact's file {str(path)!r} is missing: export it again.")
    if "input_names" not in record:
        raise ConfigError(f"The {fmt} artifact's entry in best_config.json lacks `input_names`: export it again.")
    batch_size = record.get("batch_size") or run_batch_size
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"The {fmt} artifact records no batch size (got {batch_size!r}): export it again.")
    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"`device` must be 'cpu' or 'cuda[:N]', but got {device!r}.") from None
    return Predictor(_open(fmt, path, record, device), fmt, path, record, batch_size, device)
