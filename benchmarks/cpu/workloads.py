"""The CPU family's workloads, each built as the dict a cfg.py defines (``benchmarks/cpu/__init__.py``
registers them, by the names in brackets).

    quickstart()   examples/quickstart.py as it is (quickstart)
    digits()       the CNN of examples/digits.py on scikit-learn's handwritten digits (digits)
    transformer()  a 2-layer TransformerEncoder over token ids with a padding mask, dict samples (transformer-small)
    encoder()      the same classifier at 6 layers, hidden 384 (MiniLM's shape), random weights (transformer)
    lstm()         an LSTM over (time, features) float sequences (lstm)
    resnet()       a ResNet-50-shaped CNN on small float images, random weights (resnet)
    digits_mlp(), digits_cnn()   an MLP and a small CNN from fresh weights, to train (digits-mlp, digits-cnn)

transformer() and lstm() learn synthetic tasks that a small model masters only after training
(chance is 25%), so a compression setting that damages the model shows up as lost accuracy.
Each is trained here, seeded, in 2-15 s on 2 CPU cores: the same weights on every run.
encoder() would take minutes to train on 2 cores, so its guard is fidelity to the baseline's
outputs (no metric), as for a user who gives none.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
N_CLASSES = 4


def quickstart() -> dict[str, Any]:
    """examples/quickstart.py as it is."""
    import autotune

    return autotune.load_config(ROOT / "examples" / "quickstart.py")


def digits() -> dict[str, Any]:
    """examples/digits.py as it is: model, dataset, metric, loss_fn, train_dataset, test_dataset."""
    import autotune

    return autotune.load_config(ROOT / "examples" / "digits.py")


def _accuracy(outputs: torch.Tensor, labels: torch.Tensor) -> float:
    return (outputs.argmax(1) == labels).float().mean().item()


def _train(
    net: nn.Module, samples: list, loss_fn: Callable, n_epochs: int, lr: float, batch_size: int = 64
) -> nn.Module:
    """Adam over shuffled batches of ``samples``; seeded, so every run gets the same weights."""
    from torch.utils.data import DataLoader

    from autotune.data import model_inputs

    torch.manual_seed(0)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    loader = DataLoader(samples, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(1))
    net.train()
    for _ in range(n_epochs):
        for batch in loader:
            args, kwargs = model_inputs(batch)
            loss = loss_fn(net(*args, **kwargs), batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()


def _report(name: str, net: nn.Module, test: list, metric: Callable, started: float) -> None:
    from torch.utils.data import default_collate

    from autotune.data import model_inputs

    batch = default_collate(test)
    args, kwargs = model_inputs(batch)
    with torch.inference_mode():
        acc = metric(net(*args, **kwargs), batch)
    print(f"{name}: trained in {time.perf_counter() - started:.1f} s, held-out test accuracy {acc:.4f}", flush=True)


# -----------------------------------------------------------------------------
# transformer: which keyword class occurs most often in a padded token sequence

SEQ_LEN = 64
VOCAB = 128
N_KEYWORDS = 4  # keyword tokens per class: ids 1..16; 0 is padding, 17.. are filler


class TokenClassifier(nn.Module):
    """Token ids (B, 64) and their mask -> TransformerEncoder -> masked mean -> (B, 4) logits."""

    def __init__(self, d_model: int = 128, n_heads: int = 4, n_layers: int = 2, d_ff: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(SEQ_LEN, d_model)
        d_ff = d_ff or 2 * d_model
        layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=d_ff, dropout=0.1, batch_first=True)
        # No nested tensors: the padded batch keeps one shape, which export and compile need.
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, N_CLASSES)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # ids: (B, T) int64; mask: (B, T) bool, True at real tokens (False at padding).
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.pos(positions)  # (B, T, d_model)
        x = self.encoder(x, src_key_padding_mask=~mask)
        keep = mask.unsqueeze(-1).to(x.dtype)  # (B, T, 1)
        return self.head((x * keep).sum(1) / keep.sum(1).clamp_min(1.0))


def _token_samples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of 24-64 filler tokens with 0-5 keywords of each class among them; the label
    is the class with the most keywords, two or more ahead of the next. Padded to 64."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    while len(samples) < n:
        counts = torch.randint(0, 6, (N_CLASSES,), generator=gen)
        top2 = counts.topk(2).values
        if top2[0] - top2[1] < 2:
            continue  # the winner leads by two keywords or more: one miscounted token is no tie
        length = int(torch.randint(24, SEQ_LEN + 1, (), generator=gen))
        ids = torch.zeros(SEQ_LEN, dtype=torch.int64)
        ids[:length] = torch.randint(1 + N_CLASSES * N_KEYWORDS, VOCAB, (length,), generator=gen)
        keywords = torch.cat(
            [c * N_KEYWORDS + 1 + torch.randint(0, N_KEYWORDS, (int(k),), generator=gen) for c, k in enumerate(counts)]
        )
        where = torch.randperm(length, generator=gen)[: len(keywords)]
        ids[where] = keywords
        mask = torch.arange(SEQ_LEN) < length
        samples.append({"ids": ids, "mask": mask, "labels": counts.argmax()})
    return samples


def _token_metric(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> float:
    """Accuracy of one batch: ``outputs`` (B, 4) logits."""
    return _accuracy(outputs, batch["labels"])


def _token_loss(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, batch["labels"])


def transformer() -> dict[str, Any]:
    """A 2-layer, d_model 128, 4-head encoder classifier, trained on 6,000 sequences."""
    started = time.perf_counter()
    # One pass over many fresh sequences generalises better than epochs over few.
    train, tune, test = _token_samples(6000, 0), _token_samples(512, 1), _token_samples(512, 2)
    torch.manual_seed(0)
    model = _train(TokenClassifier(), train, _token_loss, n_epochs=1, lr=2e-3, batch_size=32)
    _report("transformer", model, test, _token_metric, started)
    return {
        "model": model,
        "dataset": tune,
        "metric": _token_metric,
        "loss_fn": _token_loss,
        "train_dataset": train,
        "test_dataset": test,
    }


def encoder() -> dict[str, Any]:
    """6 layers, hidden 384, 6 heads, feed-forward 1536 (7.2M parameters, about 0.7 GMACs per
    sequence of 64), random weights. 128 tuning sequences (so batches of at most 128: one takes
    about a second on 2 cores), 64 of them for the guard."""
    torch.manual_seed(0)
    model = TokenClassifier(d_model=384, n_heads=6, n_layers=6, d_ff=1536).eval()
    return {"model": model, "dataset": _token_samples(128, 1), "options": {"n_val": 64}}


# -----------------------------------------------------------------------------
# lstm: which of four frequencies a noisy multichannel signal carries

N_STEPS, N_FEATURES = 32, 16


class SequenceClassifier(nn.Module):
    """(B, 32, 16) float sequences -> LSTM(hidden 128) -> last step -> (B, 4) logits."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.lstm = nn.LSTM(N_FEATURES, hidden, batch_first=True)
        self.head = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])  # (B, T, hidden) -> (B, hidden) -> (B, 4)


def _signal_samples(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A sine of 1, 2, 3 or 4 cycles per sequence (the label), random phase, mixed into the
    16 channels with random weights, under Gaussian noise of standard deviation 0.5."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, N_CLASSES, (n,), generator=gen)
    cycles = 1.0 + labels.float()  # (n,)
    phase = torch.rand(n, generator=gen) * 2 * math.pi
    t = torch.arange(N_STEPS) / N_STEPS  # (T,)
    wave = torch.sin(2 * math.pi * cycles[:, None] * t + phase[:, None])  # (n, T)
    mixing = torch.randn(n, 1, N_FEATURES, generator=gen)
    x = wave[:, :, None] * mixing + 0.5 * torch.randn(n, N_STEPS, N_FEATURES, generator=gen)  # (n, T, F)
    return list(zip(x, labels, strict=True))


def _signal_metric(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Accuracy of one batch: ``outputs`` (B, 4) logits."""
    return _accuracy(outputs, batch[1])


def _signal_loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def lstm() -> dict[str, Any]:
    """A one-layer LSTM classifier (hidden 128), trained on 4,000 sequences."""
    started = time.perf_counter()
    train, tune, test = _signal_samples(4000, 0), _signal_samples(512, 1), _signal_samples(512, 2)
    torch.manual_seed(0)
    model = _train(SequenceClassifier(), train, _signal_loss, n_epochs=8, lr=3e-3)
    _report("lstm", model, test, _signal_metric, started)
    return {
        "model": model,
        "dataset": tune,
        "metric": _signal_metric,
        "loss_fn": _signal_loss,
        "train_dataset": train,
        "test_dataset": test,
    }


# -----------------------------------------------------------------------------
# resnet: a ResNet-50-shaped CNN beside OpenVINO's hand recipes


def resnet() -> dict[str, Any]:
    """Bottleneck blocks, one per stage, 64 channels wide, random weights seeded, on 256 in-memory
    float images of 64x64; 128 more as ``train_dataset``, never tuned on (a calibration's). No
    metric: the guard is fidelity to the baseline's logits."""
    from benchmarks.gpu.models import FloatImages, resnet50

    images = FloatImages(256 + 128, size=64, seed=0)
    samples = [images[i] for i in range(len(images))]
    model = resnet50(width=64, layers=(1, 1, 1, 1))
    return {"model": model, "dataset": samples[:256], "train_dataset": samples[256:]}


# -----------------------------------------------------------------------------
# digits-mlp, digits-cnn: training across processes, from fresh weights


def digit_images() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """All 1,797 of scikit-learn's digits: ((1, 8, 8) float32 in [0, 1], label)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    return list(zip(x, torch.tensor(d.target), strict=True))


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                 nn.Linear(512, 10))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(64 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).flatten(1))


def cross_entropy(outputs: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def digits_mlp() -> dict[str, Any]:
    """A 3-layer MLP (the class: each trial builds it, seeded) over every digit, to train."""
    return {"model": DigitsMLP, "dataset": digit_images(), "loss_fn": cross_entropy, "metric": None}


def digits_cnn() -> dict[str, Any]:
    """Two convolutions and a linear head (the class) over every digit, to train."""
    return {"model": DigitsCNN, "dataset": digit_images(), "loss_fn": cross_entropy, "metric": None}
