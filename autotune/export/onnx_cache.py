"""The run's cache of ONNX exports (``OUT/compile-cache/onnx``, shared by its workers), keyed
on the torch side (:func:`autotune.export.run_cache.model_key`): an ONNX Runtime trial at another
batch size or thread count, a confirmation's worker, the winner's export and a resumed run read
the graph a first export wrote (the dynamo exporter and onnxslim: 5 s of real MiniLM each time)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from autotune.export.run_cache import CacheEntry, model_key

__all__ = ["ONNX_CACHE_ENV", "cached_export"]

# Where a run's workers keep the ONNX graphs they exported (set in their environment by the run).
ONNX_CACHE_ENV = "AUTOTUNE_ONNX_CACHE"
# Bumped when what an entry holds changes: an older run's entries are then not read.
_FORMAT = 2  # 2: the record holds the model output's class (output_type)


def _entry(model: nn.Module, example: Any, salt: str) -> CacheEntry | None:
    """The entry of ``model`` exported on ``example`` as ``salt`` says, or ``None`` outside a
    run's workers or where the model cannot be keyed (exported every time, as without a cache)."""
    root = os.environ.get(ONNX_CACHE_ENV)
    if not root:
        return None
    try:
        import onnx
        import onnxslim

        versions = f"onnx:{_FORMAT}:{onnx.__version__}:{onnxslim.__version__}:{salt}"
        return CacheEntry(Path(root) / model_key(model, example, versions))
    except Exception:
        return None


def cached_export(
    model: nn.Module, example: Any, salt: str, path: Path, export: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``export()``'s record, writing ``path``: read from the run's cache where this model was
    exported so before (``onnx_cached`` then set), else made and put there (``onnx_export_s``,
    the seconds a later read skips). A graph with its weights in files beside it (over 2 GB) is
    not cached; an entry that cannot be read is made again."""
    entry = _entry(model, example, salt)
    record = entry.record() if entry is not None and entry.hit() else None
    if record is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry.folder / "model.onnx", path)
            return {**record, "path": str(path), "onnx_cached": True}
        except OSError:
            entry.drop()
    began = time.perf_counter()
    record = export()
    made_s = time.perf_counter() - began
    beside = [p for p in path.parent.iterdir() if p.name.startswith(path.name) and p != path]
    if entry is None or beside:
        return record
    kept = {k: v for k, v in record.items() if k != "path"}
    if entry.publish(lambda folder: shutil.copyfile(path, folder / "model.onnx"), kept):
        return {**record, "onnx_export_s": made_s}
    return record
