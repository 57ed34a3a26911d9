"""Every build of one worker counted its model's MACs on the example batch (0.1 s of each of
real MiniLM's builds): a structure's count is now kept for the builds of the same structure,
and a pruned build still gets its own."""

import torch

import autotune.compress.prune as prune
from autotune.config import Config
from autotune.knobs.state import BuildExtras
from autotune.trial.build import build
from tests.models import MLP


def test_builds_of_one_structure_count_macs_once_and_a_pruned_build_counts_its_own(monkeypatch):
    counted = []
    real = prune.count_macs
    monkeypatch.setattr(prune, "count_macs", lambda *a: counted.append(1) or real(*a))
    extras = BuildExtras(example=torch.randn(8, 16))
    model = MLP()
    first = build(model, Config(batch_size=8), "cpu", extras=extras)
    again = build(model, Config(batch_size=16, amp_dtype="bfloat16"), "cpu", extras=extras)
    assert first.info["macs"] == again.info["macs"] > 0 and len(counted) == 1
    pruned = build(model, Config(batch_size=8, prune_ratio=0.5), "cpu", extras=extras)
    assert len(counted) == 2 and pruned.info["macs"] < first.info["macs"]
    assert first.info["macs"] == real(MLP(), (torch.randn(8, 16),), {})[0] // 8
