"""OpenVINO IR files (:func:`save_openvino`) and the run's cache of them
(``OUT/compile-cache/openvino``, shared by its workers): each torch model converted
(:func:`float_cache`, keyed on the torch side) and each int8 model NNCF made (:func:`int8_cache`),
with the record of its making."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from autotune.export.parity import exportable, flat_inputs

__all__ = ["CACHE_ENV", "IrCache", "float_cache", "int8_cache", "save_openvino"]


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
_FLOAT_FORMAT = 1


class IrCache:
    """One model in the run's cache (:func:`int8_cache`, :func:`float_cache`): its IR and the
    record of its making."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def hit(self) -> bool:
        return (self.folder / "info.json").is_file()

    def load(self, info: dict[str, Any], flag: str = "int8_cached") -> Any:
        """The cached model, ``info`` updated with what making it recorded and ``flag``; ``None`` (and the
        entry removed, to be made again) where it cannot be read: a damaged entry must not rule
        the configuration out for the rest of the run and its resumes."""
        import json
        import shutil

        import openvino as ov

        try:
            record = json.loads((self.folder / "info.json").read_text())
            model = ov.Core().read_model(str(self.folder / "model.xml"))
        except Exception:  # any reader's failure: the entry is made again
            shutil.rmtree(self.folder, ignore_errors=True)
            return None
        info.update(record)
        info[flag] = True
        return model

    def save(self, model: Any, record: dict[str, Any]) -> bool:
        """Write ``model`` and ``record`` (what is JSON of it): whether the entry is in place (a
        failed write only skips the cache; another worker's entry may stand there already).
        Written beside the entry and renamed into place whole: workers in parallel may make the
        same entry, and a reader never sees one half written."""
        import json
        import os
        import shutil

        kept = {k: v for k, v in record.items() if isinstance(v, (str, int, float, bool, list, dict, type(None)))}
        part = self.folder.with_name(f"{self.folder.name}.{os.getpid()}.part")
        try:
            part.mkdir(parents=True, exist_ok=True)
            save_openvino(model, part / "model.xml")
            (part / "info.json").write_text(json.dumps(kept, default=str))
            part.rename(self.folder)  # fails where another worker's entry is already in place
        except (OSError, TypeError, ValueError):
            shutil.rmtree(part, ignore_errors=True)
        return self.hit()


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
    try:
        digest = _float_key(exportable(model), example, spatial)
    except Exception:  # converted every time, as without a cache
        return None
    return IrCache(Path(root) / f"float-{digest}")


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _float_key(model: nn.Module, example: Any, spatial: bool) -> str:
    import hashlib
    import inspect
    import sys
    import types

    import openvino as ov

    transformers = getattr(sys.modules.get("transformers"), "__version__", None)
    digest = hashlib.sha256(f"{_FLOAT_FORMAT}:{torch.__version__}:{ov.__version__}:{transformers}:{spatial}".encode())

    def text(value: Any) -> None:  # without addresses, which differ in every process and copy
        digest.update(_ADDRESS.sub("", repr(value)).encode())

    def code(c: types.CodeType) -> None:
        digest.update(c.co_code + repr(c.co_names).encode())
        for const in c.co_consts:  # nested code by its own bytes: its repr holds an address
            if isinstance(const, types.CodeType):
                code(const)
            else:
                text(sorted(map(repr, const)) if isinstance(const, frozenset) else const)

    seen: set[int] = set()
    for module in model.modules():
        cls = type(module)
        text(f"{cls.__module__}.{cls.__qualname__}")
        for klass in cls.__mro__:
            if klass in (nn.Module, object) or id(klass) in seen:
                continue
            seen.add(id(klass))
            for name, member in sorted(vars(klass).items()):
                function = inspect.unwrap(member) if callable(member) else None
                if isinstance(function, types.FunctionType):
                    text(name)
                    code(function.__code__)
                    text(function.__defaults__)
        # Its plain settings (autocast's dtype, a flag forward reads), which repr may not show.
        text(sorted((k, v) for k, v in vars(module).items() if isinstance(v, (str, int, float, bool, type(None)))))
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            text(config)
    text(model)
    names, inputs, _ = flat_inputs(example)
    text(names)
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in [*tensors, *zip(names, inputs, strict=True)]:
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if tensor.numel():
            digest.update(tensor.view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()[:24]
