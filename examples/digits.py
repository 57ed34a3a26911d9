"""A cfg.py: a small CNN on scikit-learn's handwritten digits, real data that ships with sklearn.

    pip install -e ".[examples]"  # scikit-learn, for its digits
    autotune run examples/digits.py

The model is trained once, when this file is executed (a few seconds on a CPU), and autotune
then searches for the fastest configuration whose accuracy stays within one point of it. The
held-out split is ``test_dataset``: tune on ``dataset``, report on ``test_dataset``.
"""

import time

import torch
from torch import nn

try:
    from sklearn.datasets import load_digits
except ModuleNotFoundError as exc:  # scikit-learn is the examples extra's, not autotune's own
    raise ModuleNotFoundError('this example needs scikit-learn: pip install -e ".[examples]"') from exc

# 1,797 grey-scale 8x8 images of the digits 0-9, pixel values 0..16.
_digits = load_digits()
_x = torch.tensor(_digits.images, dtype=torch.float32).div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8) in [0, 1]
_y = torch.tensor(_digits.target, dtype=torch.int64)  # (1797,)

# A fixed permutation splits the data the same way on every machine and every run:
# 60% to train the model, 20% to tune it (the guard's accuracy) and 20% held out to report.
_perm = torch.randperm(len(_y), generator=torch.Generator().manual_seed(0))
_n_test = _n_tune = len(_y) // 5  # 359 each
_test_idx, _tune_idx, _train_idx = _perm[:_n_test], _perm[_n_test : _n_test + _n_tune], _perm[_n_test + _n_tune :]


def _samples(idx: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Indexing copies: each split owns its own (small) storage, so pickling one split for the
    # trial worker does not drag the whole data set along.
    return list(zip(_x[idx], _y[idx], strict=True))


dataset = _samples(_tune_idx)  # 359 samples of ((1, 8, 8) float32, () int64)
test_dataset = _samples(_test_idx)  # 359 held-out samples: scored after the search, never used to choose
train_dataset = _samples(_train_idx)  # 1,079 samples: what pruned candidates are fine-tuned on


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 pooling, two linear layers: 151k parameters."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),  # (B, 32, 8, 8)
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),  # (B, 64, 8, 8)
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 64, 4, 4)
        )
        self.head = nn.Sequential(
            nn.Flatten(),  # (B, 1024)
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, n_classes),  # (B, 10) logits
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def accuracy(net: nn.Module, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Share of ``samples`` whose top logit is the label."""
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    with torch.inference_mode():
        return (net.eval()(x).argmax(1) == y).float().mean().item()


def _train(n_epochs: int = 10, batch_size: int = 64) -> DigitsCNN:
    # Seeded: the same weights on every run, so the tuning baseline is reproducible.
    torch.manual_seed(0)
    net = DigitsCNN()
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    x, y = _x[_train_idx], _y[_train_idx]  # (1079, 1, 8, 8), (1079,)
    shuffle = torch.Generator().manual_seed(1)
    for _ in range(n_epochs):
        for idx in torch.randperm(len(y), generator=shuffle).split(batch_size):
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()


_start = time.perf_counter()
# Trained here, once: autotune sends this trained module to its trial workers, which never retrain.
model = _train()
_train_s = time.perf_counter() - _start
print(f"digits: trained in {_train_s:.1f} s, held-out test accuracy {accuracy(model, test_dataset):.4f}")


def metric(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Accuracy of one batch: ``outputs`` (B, 10) logits, ``batch`` ((B, 1, 8, 8), (B,)) on the device."""
    return (outputs.argmax(1) == batch[1]).float().mean().item()


def loss_fn(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy: lets autotune fine-tune pruned candidates (the finetune_steps knob)."""
    return nn.functional.cross_entropy(outputs, batch[1])


# At most one point of accuracy (about 4 of the 359 tuning images) may be traded for speed.
max_metric_drop = 0.01
options = {"n_trials": 20, "timeout": 600}
