"""Third trust pass on int8 fallback: k beyond the layer count, the auto threshold in the guard's
own terms and on real tokens only, and a ranking that streams, keeps to its budget and persists."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.compress.fallback import Int8Plan, torch_with_fallback
from autotune.errors import TrialError
from tests.models import MLP, classification_data


def _batches(samples: list, size: int = 16) -> list:
    from torch.utils.data import default_collate

    return [default_collate(samples[i : i + size]) for i in range(0, len(samples), size)]


@pytest.mark.parametrize("k", [4, 8])
def test_a_fallback_beyond_the_layer_count_is_infeasible_not_an_error(k):
    # MLP has two Linear layers: keeping 4 or 8 float keeps them all, which is no int8 at all.
    # An "unsupported" TrialError is an infeasible trial, which the path rule does not count.
    model = MLP().eval()
    with pytest.raises(TrialError) as caught:
        torch_with_fallback(model, "int8_dynamic", k, _batches(classification_data(64)), Int8Plan(), {})
    from autotune.trial.faults import classify

    assert classify(caught.value)[:2] == ("infeasible", "unsupported")  # not an error the path rule counts
    assert "keeping 2 layers float leaves none of the 2" in str(caught.value)


class _Percent:
    """A user metric in percent: 100 x the mean cosine of each sample's output to the float
    FragileMLP's (higher is better; ``max_metric_drop=1.0`` means one point)."""

    def __init__(self) -> None:
        from tests.models import FragileMLP

        self.float_model = FragileMLP().eval()

    def __call__(self, outputs: torch.Tensor, batch: torch.Tensor) -> float:
        with torch.no_grad():
            expected = self.float_model(batch)
        return 100.0 * float(nn.functional.cosine_similarity(outputs, expected).mean())


def test_auto_holds_the_users_metric_on_its_own_scale():
    # With a metric in percent and max_metric_drop=1.0 (one point), the old threshold was a
    # fidelity of 1 - 1.0 = 0: every candidate passed and auto kept nothing float, ruining the
    # model. The metric's own drop on the calibration batches must decide.
    from tests.models import FragileMLP, vector_data

    batches = _batches(vector_data(64), 16)
    plan = Int8Plan(max_drop=1.0, metric=_Percent())
    _, info = torch_with_fallback(FragileMLP().eval(), "int8_dynamic", "auto", batches, plan, {})
    assert "fc.2" in info["int8_kept"] and info["int8_fallback_score"] >= -1.0


def test_auto_ranks_only_when_every_layer_in_int8_misses_the_guard():
    # Ranking costs seconds (5.9 s of a first OpenVINO int8 trial of real MiniLM). auto tries
    # every layer in int8 first: where that holds the guard, nothing is ranked or kept float.
    from tests.models import FragileMLP, vector_data

    plan = Int8Plan(max_drop=0.05)  # every layer of MLP in int8 scores 0.98 here: it passes
    _, info = torch_with_fallback(MLP().eval(), "int8_dynamic", "auto", _batches(classification_data(64)), plan, {})
    assert info["int8_k"] == 0 and info["int8_kept"] == [] and "int8_ranking" not in info and not plan.rankings
    # Where it misses, the ranking is made, kept in the plan and recorded, and names the layer.
    _, info = torch_with_fallback(FragileMLP().eval(), "int8_dynamic", "auto", _batches(vector_data(64)), plan, {})
    assert info["int8_kept"] == ["fc.2"] and "int8_ranking" in info and len(plan.rankings) == 1


class _NoisyPadding(nn.Module):
    """Per-token outputs (B, S, 16). At padding positions (``attention_mask`` 0) the output is
    layer ``a``'s int8 rounding error magnified: zero in float, large once ``a`` is int8, as the
    garbage a real encoder leaves at positions no one reads. Real tokens quantize well."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.a, self.b = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
        self.shadow = nn.Parameter(self.a.weight.detach().clone())  # a float copy int8 leaves alone

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        hidden = self.a(x)
        noise = 1000.0 * (hidden - nn.functional.linear(x, self.shadow))
        pad = (attention_mask == 0).unsqueeze(-1).to(x.dtype)
        return self.b(hidden) * (1 - pad) + noise * pad


def test_auto_scores_real_tokens_only_as_the_guard_does():
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(1, 50, (8, 12), generator=gen)
        mask = torch.ones(8, 12, dtype=torch.long)
        ids[:, 8:], mask[:, 8:] = 0, 0  # four padding positions per sample
        batches.append({"input_ids": ids, "attention_mask": mask})
    plan = Int8Plan(kinds=["embedding"], max_drop=0.05)
    _, info = torch_with_fallback(_NoisyPadding().eval(), "int8_dynamic", "auto", batches, plan, {})
    # With padding counted, int8 of layer a ruins the padding rows and auto keeps it float.
    assert info["int8_k"] == 0 and info["int8_fallback_score"] >= 0.95


def test_a_small_dataset_holds_calibration_out_of_validation():
    from autotune.data import calibration_split

    assert calibration_split(1000, 512) == (512, None)
    assert calibration_split(40, 512) == (30, None)  # a quarter held out for calibration
    assert calibration_split(20, 512) == (12, None)  # at least 8
    n_val, why = calibration_split(12, 512)
    assert n_val == 12 and "train_dataset=" in why and "12" in why
    assert calibration_split(12, 512, has_train_dataset=True) == (12, None)


def test_too_few_samples_leave_calibrating_int8_out_or_refuse_when_fixed():
    import autotune
    from autotune.errors import ConfigError
    from tests.models import FragileMLP, vector_data

    space = {"base": None, "quantization": "all"}
    _, _, few = autotune.plan(FragileMLP(), vector_data(12), space=space, device="cpu")
    assert few.values["int8_fallback"] == [0] and "int8_static" not in few.values["quantization"]
    assert "train_dataset=" in few.excluded["int8_fallback"]["auto"]
    assert "train_dataset=" in few.excluded["quantization"]["int8_static"]
    with pytest.raises(ConfigError, match=r"Cannot fix int8_fallback=.*train_dataset="):
        autotune.plan(FragileMLP(), vector_data(12), space=space, fix={"int8_fallback": "auto"}, device="cpu")
    _, _, more = autotune.plan(FragileMLP(), vector_data(12), space=space, device="cpu", train_dataset=vector_data(64))
    assert "auto" in more.values["int8_fallback"] and "int8_static" in more.values["quantization"]


def test_the_run_validates_on_samples_calibration_never_sees(tmp_path):
    import json

    import autotune
    from tests.models import FragileMLP, vector_data

    fast = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0}
    autotune.optimize(
        FragileMLP(), vector_data(40), space={"base": None}, n_trials=1, out_dir=tmp_path, export=(), device="cpu",
        isolation="inprocess", measure={**fast, "max_cov": 1.0}, n_verify_pairs=2,
    )  # fmt: skip
    guard = json.loads((tmp_path / "best_config.json").read_text())["guard"]
    assert guard["n_val"] == 30 and guard["calibration"] == "dataset samples outside the validation subset"


def test_the_cheap_pass_holds_one_layers_activations_at_a_time():
    # Count the layer outputs alive while the ranking runs: each Linear's output is watched by a
    # weak reference. Kept for later (all layers, all batches), they would all stay alive.
    import weakref

    from autotune.compress.sensitivity import worst_cosine
    from autotune.compress.sensitivity_torch import rank_torch
    from tests.models import FragileMLP, vector_data

    model = FragileMLP().eval()
    alive: list = []
    most = [0]

    def watch(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        alive[:] = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(alive))
        alive.append(weakref.ref(out))

    for layer in model.fc:
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(watch)
    batches = _batches(vector_data(64), 16)
    for method in ("int8_dynamic", "int8_static"):
        most[0] = 0
        ranking = rank_torch(model, batches, worst_cosine, refine=False, method=method)
        assert ranking.layers[0] == "fc.2"  # still finds the fragile layer
        assert most[0] <= 1, method  # the previous Linear's output, consumed by its ReLU, is gone


def test_the_cheap_pass_and_the_auto_search_keep_to_the_budget():
    from autotune.compress.sensitivity import worst_cosine
    from autotune.compress.sensitivity_torch import fallback_torch, rank_torch
    from tests.models import FragileMLP, vector_data

    model, batches = FragileMLP().eval(), _batches(vector_data(128), 16)
    ranking = rank_torch(model, batches, worst_cosine, budget_s=0.0)
    assert ranking.n_batches == 1 and not ranking.exact_score  # one batch, then out of time
    full = rank_torch(model, batches, worst_cosine, refine=False)
    _, found = fallback_torch(model, full, batches, worst_cosine, 0.99, k="auto", budget_s=0.0)
    assert len(found["tries"]) == 1 and "time budget" in found["reason"]  # k = 0 measured, then stopped


def test_a_ranking_is_in_the_study_the_moment_it_is_computed(tmp_path):
    import optuna

    from autotune.compress.fallback import StudyRankings

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(storage=storage, study_name="s")
    model, batches = MLP().eval(), _batches(classification_data(64))
    plan = Int8Plan(store=StudyRankings(storage, "s"))
    with pytest.raises(TrialError):  # the trial fails after ranking (keeping 4 of 2 float) ...
        torch_with_fallback(model, "int8_dynamic", 4, batches, plan, {})
    stored = optuna.load_study(study_name="s", storage=storage).user_attrs
    assert [k for k in stored if k.startswith("int8_ranking:torch:int8_dynamic")]  # ... its ranking kept
    # A fresh worker (no rankings of its own) reads it instead of ranking again.
    _, info = torch_with_fallback(model, "int8_dynamic", 1, batches, Int8Plan(store=StudyRankings(storage, "s")), {})
    assert "int8_ranking" not in info and info["int8_k"] == 1
