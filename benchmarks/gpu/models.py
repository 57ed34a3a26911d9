"""The GPU suite's models and data: a ResNet-50-shaped CNN, a ViT-B/16-shaped encoder, and
synthetic images either already in memory as float tensors or stored as uint8 and converted
per sample on the CPU.

Random weights, seeded; no torchvision. Width, depth and image size are arguments, so a test
runs one forward of a tiny variant on the CPU:

    resnet50(width=8, layers=(1, 1, 1, 1))(torch.randn(2, 3, 32, 32))   # (2, 1000) logits
    vit_b16(image_size=32, dim=64, depth=2, heads=4)(torch.randn(2, 3, 32, 32))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

N_CLASSES = 1000


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand to 4x ``width``; a projected shortcut
    where the shape changes. (B, c_in, H, W) -> (B, 4 * width, H / stride, W / stride)."""

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-50's shape at the defaults (25.6M parameters, 4.1 GMACs at 224x224):
    (B, 3, H, W) -> stem /4 -> four stages of bottlenecks, /2 from the second on -> (B, 1000)."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, n_classes: int = N_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),  # (B, width, H/2, W/2)
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),  # (B, width, H/4, W/4)
        )
        blocks, c_in = [], width
        for i, n_blocks in enumerate(layers):
            w = width * 2**i
            for j in range(n_blocks):
                blocks.append(Bottleneck(c_in, w, stride=2 if i > 0 and j == 0 else 1))
                c_in = 4 * w
        self.blocks = nn.Sequential(*blocks)  # (B, 32 * width, H/32, W/32) with four stages
        self.head = nn.Linear(c_in, n_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(x.mean((2, 3)))  # global average pool: (B, C)


class ViT(nn.Module):
    """ViT-B/16's shape at the defaults (86.6M parameters): (B, 3, 224, 224) -> 196 patches of
    16x16 -> (B, 197, 768) with a class token -> 12 pre-norm encoder layers -> (B, 1000)."""

    def __init__(
        self,
        image_size: int = 224,
        patch: int = 16,
        dim: int = 768,
        depth: int = 12,
        heads: int = 12,
        n_classes: int = N_CLASSES,
    ) -> None:
        super().__init__()
        n_patches = (image_size // patch) ** 2
        self.patchify = nn.Conv2d(3, dim, patch, stride=patch)  # (B, dim, H/16, W/16)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(0.02 * torch.randn(1, n_patches + 1, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patchify(x).flatten(2).transpose(1, 2)  # (B, n_patches, dim)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.pos  # (B, n_patches + 1, dim)
        return self.head(self.norm(self.encoder(x)[:, 0]))  # the class token: (B, dim) -> (B, 1000)


def resnet50(**kwargs: Any) -> ResNet:
    """ResNet-50's shape (or ``kwargs``' variant), random weights seeded: the same in every worker."""
    torch.manual_seed(0)
    return ResNet(**kwargs).eval()


def vit_b16(**kwargs: Any) -> ViT:
    """ViT-B/16's shape (or ``kwargs``' variant), random weights seeded."""
    torch.manual_seed(0)
    return ViT(**kwargs).eval()


# ImageNet's per-channel statistics, what a real pipeline normalizes with.
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class FloatImages(Dataset):
    """``n`` samples ``((3, size, size) float32, label)``, already normalized and in memory: the
    loader only gathers them. Pickles as its recipe, so a trial worker regenerates the same
    tensors instead of receiving them through a pipe (n=1024 at 224 is 0.6 GB)."""

    def __init__(self, n: int, size: int = 224, seed: int = 0) -> None:
        self.args = (n, size, seed)
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 3, size, size, generator=gen)  # (n, 3, size, size)
        self.labels = torch.randint(0, N_CLASSES, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]

    def __reduce__(self) -> tuple:
        return type(self), self.args


class Uint8Images(FloatImages):
    """``n`` images stored as decoded JPEGs are, (size, size, 3) uint8; ``__getitem__`` does a
    real pipeline's CPU work per sample: HWC -> CHW, to float in [0, 1], normalized."""

    def __init__(self, n: int, size: int = 224, seed: int = 0) -> None:
        self.args = (n, size, seed)
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=gen)
        self.labels = torch.randint(0, N_CLASSES, (n,), generator=gen)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[i].permute(2, 0, 1).float().div_(255.0)  # (3, size, size) in [0, 1]
        return (x - MEAN) / STD, self.labels[i]
