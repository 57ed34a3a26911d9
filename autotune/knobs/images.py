"""The shape of image batches: ``image_padding`` and ``size_grouping``, for images of many sizes.

The image analogue of ``padding`` and ``length_grouping``: images of different sizes are padded
to each batch's largest height and width, and every padded pixel costs as much compute as a real
one. Batching images of similar shape together pads less; rounding the padded size up to a
multiple of 8, 16 or 32 gives a compiled model fewer shapes and the strides of a U-Net or a
feature pyramid the sizes they divide. Outputs still come back in dataset order, dense maps cut
to each image's own size. The batching itself lives in :mod:`autotune.shapes`.
"""

from __future__ import annotations

from typing import Any

from autotune.batching import GROUPINGS
from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register
from autotune.shapes import IMAGE_PADDINGS

_SAME_SIZE = "the samples are not images of different sizes"


@register
class ImagePadding(Knob):
    name = "image_padding"
    order = 26
    stage = Stage.LOADER
    choices = IMAGE_PADDINGS
    default = "largest"
    help = (
        "How images of different sizes are padded into a batch: to the batch's largest height and width, or "
        "rounded up to a multiple of 8, 16 or 32 (fewer shapes for a compiled model). Only when autotune "
        "batches the images (no collate_fn of the user's)."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if not ctx.data.images_vary:
            return Offer(["largest"], {v: _SAME_SIZE for v in self.choices[1:]})
        if ctx.data.collate != "image":
            why = "the user's collate_fn pads the images"
            return Offer(["largest"], {v: why for v in self.choices[1:]})
        return Offer(list(self.choices))

    def apply(self, state: Any, value: str) -> None:
        state.image_padding = value


@register
class SizeGrouping(Knob):
    name = "size_grouping"
    order = 27
    stage = Stage.LOADER
    choices = GROUPINGS
    default = 0
    help = (
        "Batches of images of similar shape: samples sorted by aspect ratio, then area, within windows of this "
        "many batches (0: dataset order), so a batch pads to less. Outputs still come back in dataset order."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if not ctx.data.images_vary:
            return Offer([0], {str(v): _SAME_SIZE for v in self.choices[1:]})
        return Offer(list(self.choices))

    def apply(self, state: Any, value: int) -> None:
        state.size_grouping = value
