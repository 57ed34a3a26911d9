"""What the run's caches of exported and converted models (:mod:`autotune.export.ov_cache`,
:mod:`autotune.export.onnx_cache`, in ``OUT/compile-cache``, shared by its workers) have in
common: an entry (a folder of files and the record of their making, written whole) and the key
of a torch model with the example batch it is exported on, the same in every process and copy."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.export.parity import flat_inputs

__all__ = ["CacheEntry", "model_digest", "model_key"]


class CacheEntry:
    """One entry of a run's cache: a folder with its files and ``info.json``, the record of
    their making."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def hit(self) -> bool:
        return (self.folder / "info.json").is_file()

    def record(self) -> dict[str, Any] | None:
        """The record, or ``None`` (and the entry removed, to be made again) where it cannot be
        read: a damaged entry must not rule a configuration out for the rest of a run and its resumes."""
        try:
            return json.loads((self.folder / "info.json").read_text())
        except (OSError, ValueError):
            self.drop()
            return None

    def drop(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def publish(self, write: Callable[[Path], None], record: dict[str, Any]) -> bool:
        """``write`` the files into a folder and ``record`` (what is JSON of it) beside them:
        whether the entry is in place (a failed write only skips the cache; another worker's
        entry may stand there already). Written beside the entry and renamed into place whole:
        workers in parallel may make the same entry, and a reader never sees one half written."""
        kept = {k: v for k, v in record.items() if isinstance(v, (str, int, float, bool, list, dict, type(None)))}
        part = self.folder.with_name(f"{self.folder.name}.{os.getpid()}.part")
        try:
            part.mkdir(parents=True, exist_ok=True)
            write(part)
            (part / "info.json").write_text(json.dumps(kept, default=str))
            part.rename(self.folder)  # fails where another worker's entry is already in place
        except (OSError, TypeError, ValueError):
            shutil.rmtree(part, ignore_errors=True)
        return self.hit()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def model_key(model: nn.Module, example: Any, salt: str) -> str:
    """A digest of ``model`` and ``example`` with ``salt`` (what the cache's reader does with
    them, and its versions): the code of every method its classes define (decorators unwrapped),
    its structure (``repr`` without addresses, each module's plain attributes, a Hugging Face
    ``config``), every parameter and buffer, the example batch, and the torch and transformers
    versions. Code in functions outside its classes is not in it: a run's caches hold one model.
    Raises where a part cannot be read (a quantized tensor, a ``repr`` that raises)."""
    import hashlib
    import inspect
    import sys
    import types

    transformers = getattr(sys.modules.get("transformers"), "__version__", None)
    digest = hashlib.sha256(f"{salt}:{torch.__version__}:{transformers}".encode())

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
        # Its plain settings (autocast's dtype, a flag forward reads), which repr may not show; not
        # its mode, which every reader sets (an export, a conversion: eval) and a run leaves changed.
        plain = (str, int, float, bool, type(None))
        text(sorted((k, v) for k, v in vars(module).items() if isinstance(v, plain) and k != "training"))
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


def model_digest(model: nn.Module) -> str | None:
    """``model``'s key (:func:`model_key`) without an example batch, computed where the model is
    (a worker builds a factory's): what the runs' history is kept by; ``None`` where it cannot
    be made (a quantized tensor, a ``repr`` that raises)."""
    try:
        return model_key(model, torch.empty(0), "model")
    except Exception:  # no history for this model: its first builds are priced from the priors
        return None
