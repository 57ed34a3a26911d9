"""``compile_mode``: ``torch.compile`` and its mode; ``compile_dynamic``: shapes as symbols."""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def importable_globals(model: torch.nn.Module) -> list[str]:
    r"""Make the module of each class in ``model`` importable under the name its functions'
    globals carry, as ``torch.compile`` needs: dynamo imports that name to guard the globals of
    the functions it traces. A module loaded by hand (``importlib.util.module_from_spec``, then
    ``exec_module``, never put in ``sys.modules``) or a file run by ``runpy.run_path`` failed
    every compile with ``No module named 'name'``. The module that owns the globals is
    registered under its name; where none does (``runpy``'s), a module holding them. A name
    ``sys.modules`` holds already is left as it is.

    Returns:
        The names registered.

    Example:
        >>> ns = {"__name__": "__by_hand_example__", "torch": torch}
        >>> exec("class Net(torch.nn.Module):\n    def forward(self, x):\n        return x", ns)
        >>> importable_globals(ns["Net"]()), sys.modules["__by_hand_example__"].Net is ns["Net"]
        (['__by_hand_example__'], True)
    """
    import gc

    registered: list[str] = []
    for cls in {type(m) for m in model.modules()}:
        for klass in cls.__mro__:
            if klass.__module__ in sys.modules:  # torch's, the user's imported modules: the usual case
                continue
            for value in vars(klass).values():
                fn = getattr(value, "__func__", value)  # staticmethod, classmethod
                name = getattr(fn, "__globals__", {}).get("__name__")
                if not isinstance(fn, types.FunctionType) or not isinstance(name, str) or name in sys.modules:
                    continue
                owned = fn.__globals__
                owner = next(
                    (r for r in gc.get_referrers(owned) if isinstance(r, types.ModuleType) and vars(r) is owned), None
                )
                if owner is None:
                    owner = types.ModuleType(name)
                    vars(owner).update(owned)
                sys.modules[name] = owner
                registered.append(name)
    return registered


class PaddedToCaptured(torch.nn.Module):
    """A module compiled with CUDA graphs, fed the one batch size it captured, whose outputs outlive
    the next call.

    A graph replays one shape: an epoch's short last batch would record a graph of its own (or
    fall back to launching kernels) inside the user's loop. Here it is padded to the captured
    size (its last sample repeated) and the padded rows are dropped from the outputs, so every
    call replays the same graph and gives exactly the rows it was given. ``batch_size=None``
    (symbolic shapes) pads nothing.

    A replay writes its outputs into the graph's own buffers, which the next replay overwrites: a
    user who keeps each batch's outputs (``predict`` does) would read the last batch's, or get
    torch's "overwritten by a subsequent run" error. Each output is copied out of them, a device
    copy that the trials time like the rest of the pipeline.

    Example:
        >>> wrapped = PaddedToCaptured(torch.nn.Linear(2, 1), 4)
        >>> wrapped(torch.ones(3, 2)).shape
        torch.Size([3, 1])
    """

    def __init__(self, compiled: torch.nn.Module, batch_size: int | None) -> None:
        super().__init__()
        self.compiled = compiled
        self.batch_size = batch_size

    @property
    def _orig_mod(self) -> Any:  # what the compile wraps, as on torch.compile's own module
        return getattr(self.compiled, "_orig_mod", self.compiled)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from autotune.samples import batch_size_of, map_tensors, pad_batch

        n = batch_size_of(args[0] if args else next(iter(kwargs.values())))
        if self.batch_size is None or n >= self.batch_size:
            return map_tensors(torch.clone, self.compiled(*args, **kwargs))
        out = self.compiled(*pad_batch(args, self.batch_size), **pad_batch(kwargs, self.batch_size))
        return map_tensors(lambda t: t[:n].clone() if t.dim() > 0 else t.clone(), out)


@register
class CompileMode(Knob):
    name = "compile_mode"
    memory = True
    code = "path"
    heavy = True
    order = 60
    stage = Stage.COMPILE
    choices = (
        "none",
        "default",
        "default-freezing",
        "reduce-overhead",
        "max-autotune",
        "max-autotune-no-cudagraphs",
    )
    default = "none"
    help = (
        "torch.compile with this mode: fuses operations into generated kernels. Costs compile time "
        "(reported as compile_s); the CUDA-graph modes also cut launch overhead on GPU. "
        "default-freezing also folds the weights into the compiled graph as constants (inference only)."
    )

    def applies(self, config: dict[str, Any]) -> bool:
        return config.get("runtime", "torch") == "torch"

    def offer(self, ctx: SpaceContext) -> Offer:
        env = ctx.env
        if env.compiler is None:
            need = "Triton" if env.is_cuda else "a C++ compiler (g++)"
            return Offer(["none"], {m: f"torch.compile needs {need}, which is not installed" for m in self.choices[1:]})
        excluded = {}
        if not env.is_cuda:
            excluded = {m: "uses CUDA graphs, which exist on CUDA devices only" for m in _CUDA_GRAPH_MODES}
        if ctx.mode == "train":
            excluded["default-freezing"] = "freezes the weights into constants: inference only"
        return Offer([m for m in self.choices if m not in excluded], excluded)

    def apply(self, state: Any, value: str) -> None:
        import torch._inductor

        from autotune.export.parity import CompiledWith, FrozenCompiled

        # Static shapes compile to the fastest kernels; token sequences trimmed to each batch's
        # length may ask for symbolic ones (compile_dynamic) instead of one compile per length.
        dynamic = bool(state.config is not None and state.config.get("compile_dynamic", False))
        mode = value.removesuffix("-freezing")
        if value != "none":
            importable_globals(state.model)  # dynamo imports each traced function's module by name
        if value == "none":
            pass
        elif value.endswith("-freezing") or state.quantization == "int8_static":
            # Weights frozen into constants: folded into the kernels, and the only way statically
            # quantized (PT2E) graphs reach int8 kernels; dynamo decides it from inductor's
            # global config while it traces, so the wrapper turns it on around each call. As
            # options too: a backend of its own, which dynamo's cache never serves another
            # build's graph (an unfrozen one compiled first in the process ran as "freezing").
            options = {**torch._inductor.list_mode_options(mode, dynamic), "freezing": True}
            state.model = FrozenCompiled(
                torch.compile(state.model, options=options, dynamic=dynamic), fixed_floats=dynamic
            )
        else:
            state.model = torch.compile(state.model, mode=mode, dynamic=dynamic)
            if dynamic:  # the model's floats stay constants (see CompiledWith): one trace, not two
                state.model = CompiledWith(state.model, fixed_floats=True)
            if mode in _CUDA_GRAPH_MODES and str(state.device).startswith("cuda"):
                captured = None if dynamic or state.config is None else int(state.config.get("batch_size", 1))
                state.model = PaddedToCaptured(state.model, captured)
        state.compile_mode = value


@register
class CompileDynamic(Knob):
    name = "compile_dynamic"
    code = "path"
    held = True
    order = 61
    stage = Stage.COMPILE
    choices = (False, True)
    default = False
    help = (
        "torch.compile with symbolic shapes (dynamic=True): one compiled graph for every sequence "
        "length instead of one per length. For token sequences whose padding is trimmed."
    )

    def applies(self, config: dict[str, Any]) -> bool:
        return config.get("compile_mode", "none") != "none" and config.get("runtime", "torch") == "torch"

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.data.sequence is None:
            return Offer([False], {"true": "the samples are not token sequences: every batch has one shape"})
        return Offer([False, True])

    def apply(self, state: Any, value: bool) -> None:
        pass  # compile_mode reads it from the configuration when it compiles
