"""``flush_denormal``: treat denormal floats as zero on the CPU."""

from __future__ import annotations

import platform
from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

# torch.set_flush_denormal works on x86 with SSE3 (every x86-64 CPU) and on AArch64.
_MACHINES = ("x86_64", "amd64", "aarch64", "arm64")


@register
class FlushDenormal(Knob):
    name = "flush_denormal"
    numerics = True
    screen = (True,)
    screen_rank = 160
    stage = Stage.RUNTIME
    order = 83
    choices = (False, True)
    default = False
    help = (
        "Flush denormal floats to zero on the CPU (torch.set_flush_denormal). Arithmetic on values "
        "below 1e-38 can be many times slower on x86 CPUs."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.env.is_cuda:
            return Offer([False], {"true": "a CPU setting; trials run on CUDA"})
        if platform.machine().lower() not in _MACHINES:
            return Offer([False], {"true": f"flushing denormals needs x86-64 or AArch64, not {platform.machine()}"})
        return Offer([False, True])

    def apply(self, state: Any, value: bool) -> None:
        if value:
            state.settings["flush_denormal"] = True

    def activate(self, value: bool) -> None:
        import torch

        torch.set_flush_denormal(bool(value))
