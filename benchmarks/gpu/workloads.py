"""The GPU headline benchmark's workloads (:mod:`benchmarks.gpu`): ResNet-50 on 224x224 images
held in memory as float32 or as uint8, and a BERT-base-shaped encoder on token sequences of
sentence-like lengths. No torchvision or transformers: the models are defined here and in
:mod:`benchmarks.gpu.models`, with random weights, seeded. :func:`headline` and :func:`compared`
build the cfg dicts of the headline's and the gpu-compare suite's workloads, which
``benchmarks/gpu/__init__.py`` registers.

The data sets are ``TensorDataset`` s (the sequences a plain ``Dataset``) that pickle as their
recipe, so a trial worker regenerates the same tensors instead of receiving 0.6 GB through a pipe.

    text = TokenSequences(4)
    bert_base()(**pad_to_max([text[i] for i in range(4)]))  # (4, 768) sentence embeddings
    resnet50_uint8()(Uint8ImageTensors(2)[:][0])             # (2, 1000) logits from uint8 images
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from benchmarks.gpu.models import MEAN, N_CLASSES, STD, resnet50

VOCAB, MAX_LEN, PAD_ID, CLS_ID, SEP_ID = 30522, 128, 0, 101, 102
N_SAMPLES = 1024  # per data set: batch sizes up to 1024; 0.6 GB as float32 at 224x224
# Random weights give near-tied logits, whose top-1 (what the fidelity guard compares) bf16
# rounding flips more often than a trained model's: 5% may change here, not 1%.
MAX_METRIC_DROP = 0.05


class FloatImageTensors(TensorDataset):
    """``n`` normalized float32 images ``(3, size, size)`` with integer labels, in memory."""

    def __init__(self, n: int, size: int = 224, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        super().__init__(torch.randn(n, 3, size, size, generator=gen), torch.randint(0, N_CLASSES, (n,), generator=gen))
        self.args = (n, size, seed)

    def __reduce__(self) -> tuple:
        return type(self), self.args


class Uint8ImageTensors(FloatImageTensors):
    """``n`` images stored as uint8 ``(3, size, size)`` (4x less to copy), with integer labels:
    the model casts and normalizes them on the device (:class:`Uint8Input`)."""

    def __init__(self, n: int, size: int = 224, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)
        TensorDataset.__init__(self, images, torch.randint(0, N_CLASSES, (n,), generator=gen))
        self.args = (n, size, seed)


class Uint8Input(nn.Module):
    """(B, 3, H, W) uint8 -> float32 in [0, 1], normalized by ImageNet's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", MEAN.view(1, 3, 1, 1).clone())
        self.register_buffer("std", STD.view(1, 3, 1, 1).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() / 255.0 - self.mean) / self.std


def resnet50_uint8() -> nn.Module:
    """ResNet-50 whose first step turns uint8 images into normalized floats."""
    return nn.Sequential(Uint8Input(), resnet50()).eval()


class BertLayer(nn.Module):
    """A BERT encoder layer (post-norm): self-attention, then a GELU MLP of 4x the width.
    (B, L, dim) with a (B, 1, 1, L) mask (True = a real token) -> (B, L, dim)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim, eps=1e-12)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm2 = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)  # (B, heads, L, d)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, heads, L, d)
        x = self.norm1(x + self.proj(attended.transpose(1, 2).reshape(b, n, dim)))
        return self.norm2(x + self.mlp(x))


class Bert(nn.Module):
    """BERT-base's shape at the defaults (12 layers, hidden 768, 12 heads; 109.5M parameters, as
    ``BertModel``): token, position and token-type embeddings, the encoder, and the pooler.
    ``input_ids`` and ``attention_mask`` (B, L) -> (B, dim): the [CLS] token, pooled."""

    def __init__(self, dim: int = 768, depth: int = 12, heads: int = 12, vocab: int = VOCAB, max_len: int = 512):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.types = nn.Embedding(2, dim)
        self.norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(dim, heads) for _ in range(depth))
        self.pool = nn.Linear(dim, dim)
        for m in self.modules():  # BERT's initialization
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions.weight[:n] + self.types.weight[0]  # (B, L, dim)
        x = self.norm(x)
        mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, L): which keys each query may see
        for layer in self.layers:
            x = layer(x, mask)
        return torch.tanh(self.pool(x[:, 0]))  # (B, dim)


def bert_base(**kwargs: Any) -> Bert:
    """BERT-base's shape (or ``kwargs``' variant), random weights seeded."""
    torch.manual_seed(0)
    return Bert(**kwargs).eval()


class TokenSequences(Dataset):
    """``n`` token sequences of sentence-like lengths: log-normal around a median of 40 tokens,
    16 to :data:`MAX_LEN`, [CLS] first and [SEP] last; each sample ``{"input_ids": (L,),
    "attention_mask": (L,)}``, padded by :func:`pad_to_max` as a tokenizer's
    ``padding="max_length"`` would."""

    def __init__(self, n: int, seed: int = 0, vocab: int = VOCAB) -> None:
        self.args = (n, seed, vocab)
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.exp(math.log(40) + 0.5 * torch.randn(n, generator=gen)).round().clamp(16, MAX_LEN).long()
        self.ids = [torch.randint(1000, vocab, (int(k),), generator=gen) for k in lengths]
        for ids in self.ids:
            ids[0], ids[-1] = CLS_ID, SEP_ID

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def __reduce__(self) -> tuple:
        return type(self), self.args


def pad_to_max(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The user's collate: every sequence padded to :data:`MAX_LEN` -> ``(B, MAX_LEN)`` each."""
    ids = torch.full((len(samples), MAX_LEN), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(samples), MAX_LEN), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n] = sample["input_ids"]
        mask[row, :n] = sample["attention_mask"]
    return {"input_ids": ids, "attention_mask": mask}


def headline(model: Any, data: Any, collate: Any = None, n: int = N_SAMPLES) -> dict[str, Any]:
    """A headline workload: ``model`` (a factory), ``data(n)`` and the user's ``collate``."""
    cfg = {"model": model, "dataset": data(n), "max_metric_drop": MAX_METRIC_DROP}
    if collate is not None:
        cfg["options"] = {"collate_fn": collate}
    return cfg


def cross_entropy(outputs: Any, batch: Any) -> Any:
    """The loss of training mode: (B, classes) logits against the batch's (B,) labels."""
    return F.cross_entropy(outputs, batch[1])


def compared(model: Any, data: Any, n: int = N_SAMPLES) -> dict[str, Any]:
    """A gpu-compare workload: ``model`` (a factory: the worker builds it, seeded) on ``data(n)``,
    synthetic images, with the loss its training needs."""
    return {"model": model, "dataset": data(n), "max_metric_drop": MAX_METRIC_DROP, "loss_fn": cross_entropy}
