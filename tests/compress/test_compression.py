"""Compression inside the search: trials record params and MACs, the guard rules out a
destructive prune, and the shrink preset's winner holds on held-out data."""

import json
import subprocess
import sys

import pytest
import torch

import autotune
from tests.models import classification_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}


@pytest.fixture(scope="module")
def digits():
    return autotune.load_config("examples/digits.py")


def test_destructive_prune_is_infeasible_and_never_selected(tmp_path, digits):
    result = autotune.optimize(
        digits["model"],
        digits["dataset"],
        metric=digits["metric"],
        max_metric_drop=0.01,
        space={"base": None, "prune_ratio": [0.7]},
        fix={"prune_method": "structured"},
        out_dir=tmp_path,
        device="cpu",
        n_trials=2,
        measure=FAST,
        n_verify_pairs=1,
    )
    pruned = next(t.user_attrs for t in result.study.trials if t.user_attrs["config"]["prune_ratio"] == 0.7)
    assert pruned["status"] == "infeasible" and pruned["kind"] == "guard", pruned.get("reason")
    assert pruned["metric_drop"] > 0.01
    # Its numbers are kept: the pruned model really is smaller and cheaper.
    assert pruned["macs_after"] < 0.5 * pruned["macs_before"] and pruned["params_after"] < pruned["params_before"]
    assert pruned["macs"] < result.baseline["macs"]
    assert result.best_config["prune_ratio"] == 0.0


@pytest.mark.slow  # CI time: tests/compress/test_quantize.py checks int8's size and agreement, test_fallback its guard
def test_quantized_trial_is_smaller_and_guarded(tmp_path):
    from tests.compress.test_quantize import MLP  # Linear 256-512-512-10

    data = [(torch.randn(256), torch.tensor(i % 10)) for i in range(512)]
    result = autotune.optimize(
        MLP(),
        data,
        space={"base": None, "quantization": ["int8_dynamic"]},
        objectives=("size",),
        out_dir=tmp_path,
        device="cpu",
        n_trials=2,
        measure=FAST,
        n_verify_pairs=1,
        max_metric_drop=0.05,
    )
    trials = {t.user_attrs["config"]["quantization"]: t.user_attrs for t in result.study.trials}
    q, base = trials["int8_dynamic"], trials["none"]
    assert q["status"] == "ok", q.get("reason")
    assert q["size_bytes"] <= 0.35 * base["size_bytes"]
    assert result.best_config["quantization"] == "int8_dynamic"  # the size objective picked it


def test_unsupported_quantization_is_infeasible_with_the_reason(tmp_path):
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
    data = [torch.randn(3, 8, 8) for _ in range(64)]
    result = autotune.optimize(
        conv,
        data,
        space={"base": None, "quantization": ["int8_dynamic"]},
        out_dir=tmp_path,
        device="cpu",
        n_trials=2,
        measure=FAST,
        n_verify_pairs=1,
        baseline_batch_size=8,
    )
    q = next(t.user_attrs for t in result.study.trials if t.user_attrs["config"]["quantization"] == "int8_dynamic")
    assert q["status"] == "infeasible" and q["kind"] == "unsupported" and q["reason"]


def test_finetune_needs_a_loss_and_is_offered_with_one(tmp_path):
    from tests.models import MLP

    _, _, without = autotune.plan(MLP(), classification_data(), space="shrink", device="cpu")
    assert without.values["finetune_steps"] == [0] and "loss_fn" in without.excluded["finetune_steps"]["50"]
    _, _, with_loss = autotune.plan(
        MLP(), classification_data(), space="shrink", device="cpu", loss_fn=lambda o, b: o.sum()
    )
    assert with_loss.values["finetune_steps"] == [0, 50, 200, 500]
    assert with_loss.objectives == ["size", "latency"]  # the preset's own objectives
    assert "unstructured" in with_loss.values["prune_method"]  # offered because size is an objective


@pytest.mark.slow  # three minutes on 2 cores: the shrink preset's whole search on real data
def test_digits_shrink_winner_holds_on_held_out_data(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "run",
            "examples/digits.py",
            "--space",
            "shrink",
            "--trials",
            "8",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--seed",
            "1",
            "--verbose",  # the front and the held-out metric are in the whole ending
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={"COLUMNS": "200", "PATH": ""},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "feasible Pareto front" in done.stdout and "held-out test metric" in done.stdout
    best = json.loads((out / "best_config.json").read_text())
    assert best["objectives"] == ["size", "latency"]
    assert best["held_out"]["drop"] <= 0.01, best["held_out"]
    front = json.loads((out / "pareto.json").read_text())["front"]
    assert front and all(m["metric_drop"] <= 0.01 for m in front)


class _DigitsGRU(torch.nn.Module):
    """A 2-layer GRU over the 8 rows of a digit (8 steps of 8 pixels), hidden 128: 150k parameters,
    nearly all in the GRU, which only dynamic int8 quantizes."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(8, 128, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])  # (B, 8, 8) -> (B, 8, 128) -> (B, 10)


@pytest.mark.slow  # about two minutes on 2 cores: training, then the shrink preset's search
def test_shrink_finds_int8_that_quarters_a_recurrent_classifier(tmp_path):
    """`--space shrink` on a GRU classifier: the one configuration that quantizes the GRU
    (dynamic int8 on every layer, in float32) is screened first and wins, at most 0.4 of the
    float size, its accuracy held."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).div_(16.0)  # (1797, 8, 8)
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = _DigitsGRU()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(20):  # about 3 s: 94% on the held-out digits (6 epochs gave 78%)
        for i in range(0, 1400, 64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i : i + 64]), y[i : i + 64]).backward()
            opt.step()
    model.eval()
    accuracy = (model(x[1400:]).argmax(1) == y[1400:]).float().mean().item()
    assert accuracy > 0.8, accuracy  # a real classifier, so int8's damage would show

    def top1(outputs: torch.Tensor, batch: tuple) -> float:
        return (outputs.argmax(1) == batch[1]).float().mean().item()

    result = autotune.optimize(
        model,
        list(zip(x[1400:], y[1400:], strict=True)),
        metric=top1,
        space="shrink",
        n_trials=16,
        measure={"n_windows": 2, "window_s": 0.1, "warmup_batches": 1},
        out_dir=tmp_path,
        device="cpu",
        export=(),
        profile=False,
    )
    float_bytes = result.baseline["size_bytes"]
    assert result.best_config["quantization"] == "int8_dynamic" or result.best_config["runtime"] == "onnxruntime"
    assert result.best["size_bytes"] <= 0.4 * float_bytes, (result.best["size_bytes"], float_bytes)
    assert result.best["metric_drop"] <= 0.01
