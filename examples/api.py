"""The Python API end to end: tune a model, then run the tuned model on the tuned DataLoader.

    python examples/api.py [--out DIR] [--trials N]

The model class is defined here, in the script: autotune pickles it by value for its trial
worker, so nothing has to be importable from a package.
"""

import argparse
import time

import torch
from torch import nn

import autotune


class TinyClassifier(nn.Module):
    """A two-layer MLP: (B, 32) features -> (B, 10) logits."""

    def __init__(self, n_features: int = 32, n_hidden: int = 256, n_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, n_hidden), nn.ReLU(), nn.Linear(n_hidden, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_dataset(n_samples: int = 4096, n_features: int = 32, n_classes: int = 10) -> list:
    """``n_samples`` of ((n_features,) float32, () int64); the label is the arg-max of a fixed
    random projection, so a trained model is a real classifier rather than a coin toss."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n_samples, n_features, generator=gen)
    y = (x @ torch.randn(n_features, n_classes, generator=gen)).argmax(1)
    return list(zip(x, y, strict=True))


def train(model: nn.Module, dataset: list, n_steps: int = 300, batch_size: int = 128) -> nn.Module:
    """A few seconds of Adam on random mini-batches."""
    x = torch.stack([s[0] for s in dataset])  # (N, 32)
    y = torch.stack([s[1] for s in dataset])  # (N,)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(n_steps):
        idx = torch.randint(0, len(y), (batch_size,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def top1_agreement(model: nn.Module, tuned: nn.Module, loader, device: str) -> float:
    """Share of samples where the tuned model's top class is the original model's."""
    n_same = n_total = 0
    with torch.inference_mode():
        for x, _ in loader:  # x: (batch_size, 32); batch_size is the tuned one
            x = x.to(device)
            n_same += int((tuned(x).argmax(1) == model(x).argmax(1)).sum())
            n_total += len(x)
    return n_same / n_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=f"autotune-out/api-{time.strftime('%Y%m%d-%H%M%S')}", help="output directory")
    parser.add_argument("--trials", type=int, default=6, help="measured trials (default 6)")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dataset = make_dataset()
    model = train(TinyClassifier(), dataset)

    # No metric: the guard then scores each candidate's top-1 agreement with the untuned
    # model, and max_metric_drop=0.01 keeps only candidates that agree on 99% of samples.
    # The short timing windows keep this demo to well under a minute.
    result = autotune.optimize(
        model,
        dataset,
        space="quick",
        max_metric_drop=0.01,
        n_trials=args.trials,
        device=device,
        out_dir=args.out,
        measure={"n_windows": 3, "window_s": 0.2},
        n_verify_pairs=3,
    )
    print(f"speedup: {result.speedup:.2f}x (range {result.speedup_min:.2f}-{result.speedup_max:.2f})")
    print(f"best config: {result.best_config}")
    print(f"results in: {result.out_dir}")

    # What a user ships: the tuned model (a copy; `model` is unchanged) fed by the tuned loader.
    tuned = autotune.apply(model, result.best_config, device=device)
    loader = autotune.dataloader(dataset, result.best_config)
    agreement = top1_agreement(model.to(device), tuned, loader, device)
    print(f"top-1 agreement of tuned and original model: {agreement:.4f}")
    if agreement < 0.95:
        raise SystemExit(f"The tuned model agrees with the original on only {agreement:.2%} of samples.")


if __name__ == "__main__":
    main()
