"""The example and calibration batches a winner is built from, kept in the run's folder so that
``autotune.apply(model, out)`` rebuilds an exported, quantized or pruned winner without the
dataset: the very batches the run drew (:func:`autotune.samples.calibration_draw`).

The file holds tensors only, read with ``torch.load(weights_only=True)``: nothing in it is
unpickled beyond torch's own allowlist. Batches past :data:`MAX_BYTES` keep the example alone
(enough for a float runtime's conversion); a static int8 winner then needs ``dataset=``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

__all__ = ["FILE", "MAX_BYTES", "read_build_inputs", "write_build_inputs"]

FILE = "build_inputs.pt"
# The calibration batches of 224-pixel float images at batch 32 are 154 MB: a folder a user
# copies around keeps the example alone past this.
MAX_BYTES = 64 * 2**20


def _saved(payload: dict[str, Any]) -> bytes | None:
    """``payload`` as torch.save writes it, or ``None`` where it holds what the safe loader refuses."""
    import torch

    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception:
        return None
    return data


def write_build_inputs(out: Path, example: Any, calibration: list[Any]) -> dict[str, Any]:
    """Write the batches into ``out``; returns the record ``best_config.json`` keeps of them
    (``path`` relative to ``out``, or ``error`` where they cannot be kept)."""
    import torch

    def cpu(batch: Any) -> Any:
        from autotune.samples import to_device

        return to_device(batch, torch.device("cpu"))

    data = _saved({"example": cpu(example), "calibration": [cpu(b) for b in calibration]})
    calibrated = data is not None and len(data) <= MAX_BYTES
    if not calibrated:
        data = _saved({"example": cpu(example), "calibration": []})
    if data is None:
        return {"error": "the batches hold objects other than tensors, which the safe loader refuses"}
    (out / FILE).write_bytes(data)
    return {"path": FILE, "bytes": len(data), "calibration": calibrated}


def read_build_inputs(path: Path) -> tuple[Any, list[Any]]:
    """``(example batch, calibration batches)`` from a file :func:`write_build_inputs` wrote."""
    import torch

    from autotune.errors import InputError

    try:
        payload = torch.load(path, weights_only=True)
        return payload["example"], list(payload["calibration"])
    except Exception as exc:
        raise InputError(
            f"Cannot read the run's build inputs at {str(path)!r} ({type(exc).__name__}: {exc}): pass dataset= to "
            "autotune.apply (the data the run was given)."
        ) from None
