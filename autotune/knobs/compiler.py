"""``compile_mode``: ``torch.compile`` and its mode."""

from __future__ import annotations

from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@register
class CompileMode(Knob):
    name = "compile_mode"
    order = 60
    stage = Stage.COMPILE
    choices = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    default = "none"
    help = (
        "torch.compile with this mode: fuses operations into generated kernels. Costs compile time "
        "(reported as compile_s); the CUDA-graph modes also cut launch overhead on GPU."
    )

    def applies(self, config: dict[str, Any]) -> bool:
        return config.get("runtime", "torch") == "torch"

    def offer(self, ctx: SpaceContext) -> Offer:
        env = ctx.env
        if env.compiler is None:
            need = "Triton" if env.is_cuda else "a C++ compiler (g++)"
            return Offer(["none"], {m: f"torch.compile needs {need}, which is not installed" for m in self.choices[1:]})
        if env.is_cuda:
            return Offer(list(self.choices))
        excluded = {m: "uses CUDA graphs, which exist on CUDA devices only" for m in _CUDA_GRAPH_MODES}
        return Offer([m for m in self.choices if m not in _CUDA_GRAPH_MODES], excluded)

    def apply(self, state: Any, value: str) -> None:
        import torch

        if value == "none":
            pass
        elif state.quantization == "int8_static":
            from autotune.knobs.state import FrozenCompiled

            # Statically quantized (PT2E) graphs reach the int8 kernels only with weights frozen
            # into constants, which dynamo decides from inductor's global config while it traces.
            state.model = FrozenCompiled(torch.compile(state.model, mode=value, dynamic=False))
        else:
            # dynamic=False: the timed loop feeds one batch shape, and static shapes compile to
            # the fastest kernels.
            state.model = torch.compile(state.model, mode=value, dynamic=False)
        state.compile_mode = value
