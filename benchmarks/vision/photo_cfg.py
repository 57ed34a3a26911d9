"""A cfg.py as a user writes one for photographs: its own dataset class (JPEG files opened with
PIL in ``__getitem__``, shorter side 256, centre crop 224) and its own small CNN, defined here.

    autotune run benchmarks/vision/photo_cfg.py --trials 10 --out OUT
    python -m benchmarks.predict --cfg benchmarks/vision/photo_cfg.py --load OUT   # the claim re-timed

The 160 files are made once (:func:`benchmarks.vision.photos.make_photos`: crops of
scikit-learn's two sample photographs at 1-2 megapixels, quality 90) in
``$AUTOTUNE_PHOTOS`` or the system's temporary folder. One pass over new images in use
(``repeated_passes=False``). It checks that a claim over samples read with work (photos of
different sizes, loader workers) is what a user's ``apply`` + ``dataloader`` and ``predict`` get.
"""

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

FOLDER = Path(os.environ.get("AUTOTUNE_PHOTOS") or Path(tempfile.gettempdir()) / "autotune-photos-160")
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class Photos(torch.utils.data.Dataset):
    def __init__(self, folder):
        self.files = sorted(Path(folder).glob("*.jpg"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        image = Image.open(self.files[i]).convert("RGB")
        w, h = image.size
        scale = 256 / min(w, h)
        image = image.resize((max(256, round(w * scale)), max(256, round(h * scale))), Image.BILINEAR)
        w, h = image.size
        left, top = (w - 224) // 2, (h - 224) // 2
        a = (np.asarray(image.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 255.0 - MEAN) / STD
        return torch.from_numpy(a.transpose(2, 0, 1).copy()), i % 10


class Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.dw, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, groups=c_out, bias=False), nn.BatchNorm2d(c_out)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return x + torch.relu(self.bn2(self.dw(x)))


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(Block(3, 16, 2), Block(16, 32, 2), Block(32, 64, 2), Block(64, 128, 2))
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def model():
    torch.manual_seed(0)
    return SmallNet().eval()


if len(list(FOLDER.glob("*.jpg"))) < 160:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: the repository's benchmarks
    from benchmarks.vision.photos import make_photos

    make_photos(FOLDER, n=160)
dataset = Photos(FOLDER)
options = {"repeated_passes": False}
