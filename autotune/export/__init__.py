"""Writing and checking the files a runtime runs: ONNX (:mod:`~autotune.export.onnx`, run by
:mod:`~autotune.export.ort`), TorchScript (:mod:`~autotune.export.torchscript`) and OpenVINO
(:mod:`~autotune.export.openvino`), their parity checks (:mod:`~autotune.export.parity`) and
the run's caches of them. Which runtime's exporter runs is :mod:`autotune.runtimes`' choice; the
run's artifacts are written by :func:`autotune.runtimes.artifacts.export_artifacts`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["file_digest"]


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
