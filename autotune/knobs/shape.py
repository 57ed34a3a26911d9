"""The shape of the data: ``padding`` and ``length_grouping``, for token sequences.

Text batches are padded to a common length; every padding token costs as much compute as a
real one. Trimming each batch to its longest real sentence, and batching sentences of similar
length together, removes most of that waste; outputs still come back in dataset order. The
batching itself lives in :mod:`autotune.batching`.
"""

from __future__ import annotations

from typing import Any

from autotune.batching import GROUPINGS, PADDINGS
from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

_NOT_TEXT = "the samples are not token sequences (dicts of 1-D integer tensors)"


@register
class Padding(Knob):
    name = "padding"
    code = "variant"
    order = 24
    stage = Stage.LOADER
    choices = PADDINGS
    default = "as_given"
    help = (
        "How much padding a batch of token sequences keeps: as the collate makes it, trimmed to the "
        "batch's longest real sequence, or trimmed and rounded up to a multiple of 8, 16 or 32 "
        "(fewer shapes for a compiled model). Needs an attention_mask."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        seq = ctx.data.sequence
        if seq is None:
            return Offer(["as_given"], {v: _NOT_TEXT for v in self.choices[1:]})
        if not seq.has_mask:
            # Without a mask nothing tells real tokens from padding: the padding collate's batches.
            why = "no attention_mask tells real tokens from padding"
            return Offer([self.baseline(ctx)], {v: why for v in self.choices if v != self.baseline(ctx)})
        if ctx.data.collate == "pad":
            return Offer(list(self.choices[1:]), {"as_given": "the padding collate already trims each batch"})
        if not seq.padded and not seq.varying:
            why = "every sample has the same length, with no padding"
            return Offer(["as_given"], {v: why for v in self.choices[1:]})
        return Offer(list(self.choices))

    def baseline(self, ctx: SpaceContext) -> str:
        # Samples of different lengths padded by the automatic collate: to each batch's longest.
        return "trim" if ctx.data.collate == "pad" else "as_given"

    def apply(self, state: Any, value: str) -> None:
        state.padding = value


@register
class LengthGrouping(Knob):
    name = "length_grouping"
    order = 25
    stage = Stage.LOADER
    choices = GROUPINGS
    default = 0
    help = (
        "Batches of similar lengths: samples sorted by length within windows of this many batches "
        "(0: dataset order), so a batch pads to less. Outputs still come back in dataset order."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        seq = ctx.data.sequence
        if seq is None:
            return Offer([0], {str(v): _NOT_TEXT for v in self.choices[1:]})
        if seq.min_len == seq.max_len:
            return Offer([0], {str(v): "every sample has the same real length" for v in self.choices[1:]})
        return Offer(list(self.choices))

    def applies(self, config: dict[str, Any]) -> bool:
        # Batches padded to a fixed length cost the same in any order.
        return config.get("padding", "as_given") != "as_given"

    def apply(self, state: Any, value: int) -> None:
        state.grouping = value
