"""A key for a torch model and the example batch it is exported or converted on, the same in
every process and copy: what the run's caches of exported and converted models
(:mod:`autotune.export.ov_cache`, :mod:`autotune.export.onnx_cache`) are keyed on."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from autotune.export.parity import flat_inputs

__all__ = ["model_key"]

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
