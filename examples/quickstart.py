"""A cfg.py: a small MLP classifier on synthetic data, tuned with the default options.

autotune run examples/quickstart.py
"""

import torch
from torch import nn

# 4,096 samples of 64 features in 10 classes; the labels follow a fixed random projection, so
# the model below (trained for a few seconds) is a real classifier, not noise.
_gen = torch.Generator().manual_seed(0)
_x = torch.randn(4096, 64, generator=_gen)
_w = torch.randn(64, 10, generator=_gen)
_y = (_x @ _w).argmax(1)

dataset = list(zip(_x, _y, strict=True))


def model() -> nn.Module:
    """An MLP trained for 200 steps: fast to build, realistic to tune."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(200):
        idx = torch.randint(0, len(_x), (128,), generator=torch.Generator().manual_seed(step))
        loss = nn.functional.cross_entropy(net(_x[idx]), _y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


def metric(outputs: torch.Tensor, batch) -> float:
    """Accuracy: the share of samples whose top class is the label."""
    return (outputs.argmax(1) == batch[1]).float().mean().item()


max_metric_drop = 0.01
options = {"n_trials": 20}
