"""``channels_last``: NHWC memory format for image models."""

from __future__ import annotations

from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register
from autotune.runtimes.base import precision_knob


@register
class ChannelsLast(Knob):
    name = "channels_last"
    memory = True
    screen = (True,)
    screen_rank = 120
    order = 51
    stage = Stage.WEIGHTS
    choices = (False, True)
    default = False
    help = "Store weights and 4-D inputs as NHWC, which convolution kernels on tensor cores and oneDNN prefer."

    def applies(self, config: dict[str, Any]) -> bool:
        # ONNX Runtime and OpenVINO lay out their own graphs.
        return precision_knob(config.get("runtime", "torch")) is None

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.data.image_input:
            return Offer([False, True])
        return Offer([False], {"true": "the model's inputs are not 4-D image batches"})

    def apply(self, state: Any, value: bool) -> None:
        import torch

        state.channels_last = value
        if value:
            state.model = state.model.to(memory_format=torch.channels_last)
