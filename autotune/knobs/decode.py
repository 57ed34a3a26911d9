"""``jpeg_draft``: JPEG files decoded at reduced scale where the pipeline shrinks them anyway.

A JPEG stores 8x8 blocks of DCT coefficients, and a decoder can rebuild each block at 1/2, 1/4 or
1/8 of its size for a fraction of the work (libjpeg's DCT scaling; PIL's ``Image.draft``). A
dataset that opens 1-2 megapixel photos with PIL in ``__getitem__`` and first resizes them to a
shorter side of 256 decodes four to sixteen times the pixels it keeps.

This lever asks the decoder for the smallest scale that keeps each image at least as large as
the pipeline's first resize makes it. It applies to the user's own ``__getitem__``, unchanged:
while a sample is read, PIL's JPEG loader calls ``draft`` before decoding. What the first resize
needs is found by reading a few samples with PIL watched (:func:`probe`): each JPEG decoded, and
the first resize, crop or thumbnail applied after it. The lever is offered only where every
sample looked at decoded one JPEG and resized it (no crop before) to a shorter side that is the
same for all (``Resize(256)``), or to one fixed size, at most half the photo's own; the guard then
judges the outputs, as for any lever. A PNG, or a JPEG already no larger than the resize needs,
decodes as before; so does a corrupt file, with the same error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
from collections.abc import Iterator
from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

__all__ = ["DraftRule", "DraftedDataset", "JpegDraft", "drafted", "probe"]

# Samples read to find what the first resize needs.
N_PROBED = 3
_LOCK = threading.RLock()


@dataclasses.dataclass(frozen=True)
class DraftRule:
    """What the pipeline's first resize needs of a decoded JPEG: a ``shorter`` side of that many
    pixels, or a fixed ``size`` (width, height)."""

    shorter: int | None = None
    size: tuple[int, int] | None = None

    def request(self, width: int, height: int) -> tuple[int, int] | None:
        """The size to ask ``draft`` for, for a ``width`` x ``height`` JPEG; ``None`` where no
        scale of at most 1/2 keeps it large enough.

        Example:
            >>> DraftRule(shorter=256).request(1600, 1200), DraftRule(shorter=256).request(400, 300)
            ((342, 256), None)
        """
        if self.shorter is not None:
            k = self.shorter / min(width, height)
            want = (math.ceil(width * k), math.ceil(height * k))
        else:
            want = self.size  # type: ignore[assignment]
        if want[0] * 2 > width or want[1] * 2 > height:
            return None
        return want

    def describe(self) -> str:
        return f"shorter side {self.shorter}" if self.shorter is not None else f"{self.size[0]}x{self.size[1]}"  # type: ignore[index]


class _Watch:
    """What one sample's read did: the JPEGs decoded and the geometric operations after them."""

    def __init__(self) -> None:
        self.jpegs: list[tuple[int, int]] = []
        self.ops: list[tuple[str, tuple[int, int], Any]] = []


@contextlib.contextmanager
def _watched() -> Iterator[_Watch]:
    from PIL import Image, JpegImagePlugin

    watch = _Watch()
    load, resize, crop, thumbnail = (JpegImagePlugin.JpegImageFile.load, Image.Image.resize, Image.Image.crop,
                                     Image.Image.thumbnail)  # fmt: skip

    def jpeg_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.tile:  # not decoded yet
            watch.jpegs.append(tuple(self.size))
        return load(self, *args, **kwargs)

    def op(name: str, original: Any) -> Any:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            size = args[0] if args else kwargs.get("size")
            watch.ops.append((name, tuple(self.size), size))
            return original(self, *args, **kwargs)

        return wrapped

    with _LOCK:
        JpegImagePlugin.JpegImageFile.load = jpeg_load
        Image.Image.resize, Image.Image.crop = op("resize", resize), op("crop", crop)
        Image.Image.thumbnail = op("thumbnail", thumbnail)
        try:
            yield watch
        finally:
            JpegImagePlugin.JpegImageFile.load = load
            Image.Image.resize, Image.Image.crop, Image.Image.thumbnail = resize, crop, thumbnail


def probe(dataset: Any, n: int = N_PROBED) -> DraftRule | None:
    """The rule of :class:`DraftRule` that reading ``dataset``'s first ``n`` samples shows, or
    ``None``: PIL was never imported, a sample decoded no JPEG or several, cropped before it
    resized, resized to sizes no one rule gives, or to more than half the photo's size."""
    if "PIL.Image" not in sys.modules or not len(dataset):
        return None
    seen: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for i in range(min(n, len(dataset))):
        try:
            with _watched() as watch:
                dataset[i]
        except Exception:
            return None
        if len(watch.jpegs) != 1 or not watch.ops or watch.ops[0][0] != "resize":
            return None
        _, source, target = watch.ops[0]
        if source != watch.jpegs[0] or not isinstance(target, (tuple, list)) or len(target) != 2:
            return None
        seen.append((source, (int(target[0]), int(target[1]))))
    shorter = {min(t) for _, t in seen}
    rule = DraftRule(shorter=shorter.pop()) if len(shorter) == 1 else None
    if rule is None or any(abs(t[0] / s[0] - t[1] / s[1]) > 0.02 for s, t in seen):  # not the aspect kept
        sizes = {t for _, t in seen}
        rule = DraftRule(size=sizes.pop()) if len(sizes) == 1 else None
    if rule is None or not any(rule.request(*s) for s, _ in seen):
        return None
    return rule


@contextlib.contextmanager
def drafted(rule: DraftRule) -> Iterator[None]:
    """While the block runs, every JPEG PIL decodes is decoded at the smallest DCT scale that
    keeps it as large as ``rule`` needs (``draft``, called just before decoding)."""
    from PIL import JpegImagePlugin

    load = JpegImagePlugin.JpegImageFile.load

    def jpeg_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.tile and not getattr(self, "_autotune_drafted", False):
            self._autotune_drafted = True
            want = rule.request(*self.size)
            if want is not None:
                self.draft(self.mode, want)
        return load(self, *args, **kwargs)

    with _LOCK:
        JpegImagePlugin.JpegImageFile.load = jpeg_load
        try:
            yield
        finally:
            JpegImagePlugin.JpegImageFile.load = load


class DraftedDataset:
    """``dataset`` whose samples are read under :func:`drafted` with ``rule``; anything else is
    the dataset's own."""

    def __init__(self, dataset: Any, rule: DraftRule) -> None:
        self.dataset, self.rule = dataset, rule

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        with drafted(self.rule):
            return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "rule"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def drafted_dataset(dataset: Any) -> Any:
    """``dataset`` as a :class:`DraftedDataset` where :func:`probe` finds a rule, else itself."""
    if isinstance(dataset, DraftedDataset):
        return dataset
    rule = probe(dataset)
    return dataset if rule is None else DraftedDataset(dataset, rule)


@register
class JpegDraft(Knob):
    name = "jpeg_draft"
    claim_note = (
        "decoded",
        "JPEG files decoded at reduced scale (DCT scaling), as large as the first resize needs",
        "JPEG files decoded at reduced scale",
    )
    # Photos decoded in __getitem__ and shrunk by its first resize: decoded at the scale the resize
    # needs (1-2 MP JPEGs to a shorter side of 256 on one core: 22 ms a photo, 10 ms drafted).
    reads_samples = True
    screen = (True,)
    screen_rank = 30
    first_tier = True
    order = 27
    stage = Stage.LOADER
    choices = (False, True)
    default = False
    help = (
        "Decode JPEG files at reduced scale (1/2, 1/4 or 1/8, PIL's draft) where the dataset's __getitem__ opens "
        "them with PIL and first resizes them to at most half their size: the smallest scale that keeps each "
        "image as large as that resize needs. Offered where a few samples read show that pattern."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.jpeg is None:
            why = (
                "the samples looked at do not open one JPEG with PIL and then resize it to at most half its size "
                "(a crop first, another format, or no PIL)"
            )
            return Offer([False], {"true": why})
        return Offer([False, True])

    def apply(self, state: Any, value: bool) -> None:
        state.jpeg_draft = value
