"""Strict parity: each output against its own scale, and the artifact against the baseline."""

import torch
from torch import nn

from autotune.export.parity import check_parity


class Scaled(nn.Module):
    def __init__(self, model: nn.Module, factor: float) -> None:
        super().__init__()
        self.model, self.factor = model, factor

    def forward(self, x):
        return self.model(x) * self.factor


class TwoOutputs(nn.Module):
    """A large output and a small one: an error pooled over both would hide the small one's."""

    def __init__(self, ruin_small: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big, self.small = nn.Linear(8, 4), nn.Linear(8, 4)
        self.ruin_small = ruin_small

    def forward(self, x):
        small = 1e-3 * self.small(x)
        return {"big": 1e3 * self.big(x), "small": torch.zeros_like(small) if self.ruin_small else small}


def _samples(n: int = 32) -> list:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, generator=gen) for _ in range(n)]


def test_an_all_zero_artifact_fails_against_small_outputs():
    torch.manual_seed(0)
    model = Scaled(nn.Linear(8, 4), 1e-4).eval()  # outputs of magnitude 1e-4
    zeros = Scaled(model.model, 0.0)
    parity = check_parity(zeros, model, _samples(), 8)
    assert not parity["ok"] and parity["rel_l2"] == 1.0
    assert parity["max_abs"] < 1e-3  # what used to pass it on its own


def test_each_output_is_judged_against_its_own_scale():
    parity = check_parity(TwoOutputs(ruin_small=True).eval(), TwoOutputs().eval(), _samples(), 8)
    assert not parity["ok"] and parity["rel_l2"] == 1.0
    assert check_parity(TwoOutputs().eval(), TwoOutputs().eval(), _samples(), 8)["ok"]


def _outputs(model: nn.Module, samples: list) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.stack(samples))


def test_export_drift_cannot_stack_on_the_drift_the_guard_allowed():
    torch.manual_seed(0)
    baseline = nn.Linear(8, 16).eval()
    tuned = Scaled(baseline, 1.008).eval()  # 0.8% off the baseline: the guard passes it at 0.01
    artifact = Scaled(tuned, 1.008).eval()  # another 0.8% off the tuned model: parity alone passes
    samples = _samples()
    reference = _outputs(baseline, samples)
    alone = check_parity(artifact, tuned, samples, 8)
    assert alone["ok"]
    parity = check_parity(artifact, tuned, samples, 8, baseline_outputs=reference, kinds=["embedding"])
    assert not parity["ok"] and "untuned" in parity["reason"]
    assert parity["baseline_fidelity"] < 0.99
    assert check_parity(tuned, tuned, samples, 8, baseline_outputs=reference, kinds=["embedding"])["ok"]


def test_the_metric_is_scored_on_the_batches_the_baseline_metric_saw():
    def full_batches(outputs, batch):  # a metric that depends on the batch structure
        return float(len(outputs) == 8)

    model = nn.Linear(8, 4).eval()
    samples = _samples(32)
    # the artifact runs at batch 16, the guard scored batches of 8
    parity = check_parity(model, model, samples, 16, metric=full_batches, baseline_metric=1.0, metric_chunk=8)
    assert parity["ok"] and parity["metric"] == 1.0


def test_the_models_outputs_are_computed_once_for_every_format_checked_against_it(tmp_path, monkeypatch):
    """Each format's parity check ran the tuned model over the validation samples again: a
    second of a Hugging Face winner's export. The model's outputs are computed for the first
    format and kept for the others; each artifact still runs on its own."""
    import autotune.export.parity as parity
    from autotune.runtimes.artifacts import export_artifacts

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    samples = [torch.randn(4) for _ in range(12)]
    ran = []
    real = parity._run_batches
    monkeypatch.setattr(parity, "_run_batches", lambda fn, *a, **k: ran.append(fn is model) or real(fn, *a, **k))
    out = export_artifacts(model, torch.randn(4, 4), samples, 4, tmp_path, ["onnx", "torchscript"])
    assert [out[f]["status"] for f in ("onnx", "torchscript")] == ["ok", "ok"]
    assert ran.count(True) == 1 and ran.count(False) == 2, ran


def test_a_memo_shared_by_a_winners_export_calls_keeps_each_models_outputs_apart(tmp_path, monkeypatch):
    """A winner's export checks its formats in separate calls (the shipped file, TorchScript,
    then ONNX): one memo computes the tuned model's outputs once for all of them, and another
    model checked with the same memo is run for itself, never compared with the first's outputs."""
    import copy

    import autotune.export.parity as parity
    from autotune.runtimes.artifacts import export_artifacts

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    other = copy.deepcopy(model)
    with torch.no_grad():
        other[2].bias.add_(1.0)
    samples, example = [torch.randn(4) for _ in range(12)], torch.randn(4, 4)
    ran = []
    real = parity._run_batches
    monkeypatch.setattr(parity, "_run_batches", lambda fn, *a, **k: ran.append(fn) or real(fn, *a, **k))
    memo = {}
    first = export_artifacts(model, example, samples, 4, tmp_path / "a", ["torchscript"], memo=memo)
    second = export_artifacts(model, example, samples, 4, tmp_path / "b", ["onnx"], memo=memo)
    third = export_artifacts(other, example, samples, 4, tmp_path / "c", ["torchscript"], memo=memo)
    assert [r["status"] for r in (first["torchscript"], second["onnx"], third["torchscript"])] == ["ok"] * 3
    assert [fn is model for fn in ran].count(True) == 1 and [fn is other for fn in ran].count(True) == 1
    assert third["torchscript"]["parity"]["max_abs"] < 1e-5  # against its own model, not the first's
