"""``optimizer_impl``: which implementation of the user's optimizer runs the step (training mode).

The optimizer's hyper-parameters never change; only how its update is computed: ``default``
(as constructed), ``foreach`` (one multi-tensor kernel per operation over all parameters) or
``fused`` (the whole update in one kernel per parameter group, on CUDA and, for Adam, AdamW,
SGD and Adagrad, on the CPU).
"""

from __future__ import annotations

from typing import Any

from autotune.knobs.base import Knob, Stage, register


@register
class OptimizerImpl(Knob):
    name = "optimizer_impl"
    screen = ("fused",)
    screen_rank = 130
    first_tier = True
    order = 90
    stage = Stage.RUNTIME
    modes = ("train",)
    choices = ("default", "foreach", "fused")
    default = "default"
    help = (
        "Implementation of the optimizer step: as constructed, foreach (multi-tensor) or fused. "
        "Same hyper-parameters and, up to rounding, the same updates."
    )

    def apply(self, state: Any, value: str) -> None:
        state.optimizer_impl = value  # read when the training step builds the optimizer
