"""OpenVINO IR files (:func:`save_openvino`) and the run's cache of them
(``OUT/compile-cache/openvino``, shared by its workers): each torch model converted
(:func:`float_cache`, keyed on the torch side) and each int8 model NNCF made (:func:`int8_cache`),
with the record of its making."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from autotune.export.parity import exportable
from autotune.export.run_cache import CacheEntry, model_key

__all__ = ["CACHE_ENV", "IrCache", "float_cache", "int8_cache", "no_gain_entry", "save_openvino"]


def save_openvino(model: Any, path: Path) -> dict[str, Any]:
    """Write ``model`` as IR: ``path`` (``.xml``) and its weights beside it (``.bin``), float
    weights kept float32 (OpenVINO's default would halve them to float16).

    Returns:
        ``{"path", "bin_path", "bytes"}``, ``bytes`` of both files.
    """
    import openvino as ov

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(path), compress_to_fp16=False)
    weights = path.with_suffix(".bin")
    return {"path": str(path), "bin_path": str(weights), "bytes": path.stat().st_size + weights.stat().st_size}


# Where a run's workers keep the models they converted and the int8 models NNCF made (set in
# their environment by the run).
CACHE_ENV = "AUTOTUNE_OPENVINO_CACHE"
# Bumped when what a converted entry holds changes: an older run's entries are then not read.
_FLOAT_FORMAT = 2  # 2: the record holds the model output's class (output_type)


class IrCache(CacheEntry):
    """One model in the run's cache (:func:`int8_cache`, :func:`float_cache`): its IR and the
    record of its making."""

    def load(self, info: dict[str, Any], flag: str = "int8_cached") -> Any:
        """The cached model, ``info`` updated with what making it recorded and ``flag``; ``None`` (and the
        entry removed, to be made again) where it cannot be read."""
        import openvino as ov

        record = self.record()
        if record is None:
            return None
        try:
            model = ov.Core().read_model(str(self.folder / "model.xml"))
        except Exception:  # any reader's failure: the entry is made again
            self.drop()
            return None
        info.update(record)
        info[flag] = True
        return model

    def save(self, model: Any, record: dict[str, Any]) -> bool:
        """Write ``model`` and ``record``: whether the entry is in place (:meth:`CacheEntry.publish`)."""
        return self.publish(lambda folder: save_openvino(model, folder / "model.xml"), record)


def int8_cache(model: Any, feeds: Sequence[dict[str, np.ndarray]], settings: Any) -> IrCache | None:
    """The cache entry of ``model`` (a float ``openvino.Model``: its ops, names and weights)
    quantized on ``feeds`` with ``settings`` (JSON: the configuration, the guard), or ``None``
    outside a run's workers (:data:`CACHE_ENV` unset)."""
    import hashlib
    import json
    import os

    root = os.environ.get(CACHE_ENV)
    if not root:
        return None
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for op in model.get_ordered_ops():
        digest.update(
            f"{op.get_type_name()}:{op.get_friendly_name()}:{op.get_output_partial_shape(0) if op.get_output_size() else ''}".encode()
        )
        if op.get_type_name() == "Constant":
            digest.update(np.ascontiguousarray(op.get_data()).tobytes())
    for feed in feeds:
        for name in sorted(feed):
            digest.update(name.encode() + np.ascontiguousarray(feed[name]).tobytes())
    return IrCache(Path(root) / digest.hexdigest()[:24])


def no_gain_entry(entry: IrCache) -> CacheEntry:
    """Beside ``entry`` (an int8 model's), this CPU's verdict that the model does not pay in int8
    (``int8_fallback=auto`` for speed timed it slower than the float one): a second trial or run
    of it reads the verdict where it paid NNCF and the timing again (30 s of a 146-s warm search
    of real MiniLM on an AVX2-only CPU). Keyed on the CPU (its model, cores and the extensions
    that decide int8), since another CPU may run the same int8 model faster."""
    import hashlib
    import json

    from autotune.env import cpu_info

    cpu = {k: v for k, v in cpu_info().items() if k in ("model", "machine", "usable_cores", "isa")}
    tag = hashlib.sha256(json.dumps(cpu, sort_keys=True).encode()).hexdigest()[:12]
    return CacheEntry(entry.folder.with_name(f"{entry.folder.name}-slower-{tag}"))


def float_cache(model: nn.Module, example: Any, spatial: bool) -> IrCache | None:
    """The cache entry of ``model`` converted by :func:`convert_openvino` on ``example``, keyed
    on the torch side, so reading it skips the conversion (a trace and ``convert_model``: 1.7 s
    of a 2.2-s build of real MiniLM, in every OpenVINO trial, confirmation worker and export):
    the code of every method its classes define (decorators unwrapped), its structure (``repr``,
    each module's plain attributes, a Hugging Face ``config``), every parameter and buffer, the
    example batch, and the torch, transformers and OpenVINO versions. Code in functions outside
    its classes is not in the key: the cache is a run's (its output folder's), for one model.
    ``None`` outside a run's workers, or where the key cannot be made (a quantized tensor, a
    ``repr`` that raises)."""
    import os

    root = os.environ.get(CACHE_ENV)
    if not root:
        return None
    import openvino as ov

    try:
        digest = model_key(exportable(model), example, f"openvino:{_FLOAT_FORMAT}:{ov.__version__}:{spatial}")
    except Exception:  # converted every time, as without a cache
        return None
    return IrCache(Path(root) / f"float-{digest}")
