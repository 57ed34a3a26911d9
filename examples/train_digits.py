"""A cfg.py in training mode: find the fastest training step for a small CNN on scikit-learn's
handwritten digits that still learns the same way.

    pip install -e ".[examples]"  # scikit-learn, for its digits
    autotune run examples/train_digits.py

Every trial trains the same fresh model (same initial weights, same samples in the same order)
with AdamW for ``n_train_steps`` steps, compares its loss curve with the baseline's, then times
further steps end to end. Effective batch 64: a micro-batch of 16 is 4 accumulated steps.
Then reuse the winner in your own loop::

    t = autotune.training(DigitsCNN(), optimizer, dataset, "autotune-out")
"""

import torch
from torch import nn

try:
    from sklearn.datasets import load_digits
except ModuleNotFoundError as exc:  # scikit-learn is the examples extra's, not autotune's own
    raise ModuleNotFoundError('this example needs scikit-learn: pip install -e ".[examples]"') from exc

mode = "train"

# 1,797 grey-scale 8x8 images of the digits 0-9, pixel values 0..16.
_digits = load_digits()
_x = torch.tensor(_digits.images, dtype=torch.float32).div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8) in [0, 1]
_y = torch.tensor(_digits.target, dtype=torch.int64)  # (1797,)
dataset = list(zip(_x, _y, strict=True))  # the training samples


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
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, 10) logits


def model() -> DigitsCNN:
    # A factory, seeded: every trial (and your own run) starts from the same weights.
    torch.manual_seed(0)
    return DigitsCNN()


def loss_fn(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of (B, 10) logits against the (B,) labels of the batch."""
    return nn.functional.cross_entropy(outputs, batch[1])


# The optimizer as you would construct it; autotune tunes only its implementation (foreach, fused).
optimizer = (torch.optim.AdamW, {"lr": 2e-3, "weight_decay": 0.01})

options = {
    "n_trials": 16,
    "effective_batch_size": 64,
    "baseline_batch_size": 64,
    "n_train_steps": 30,  # 30 steps of 64 samples: the loss falls from 2.3 to about 0.5
}
