"""Fidelity judged per output by its kind, the worst output deciding."""

import pytest
import torch
import torch.nn.functional as F

from autotune.errors import ConfigError
from autotune.trial.fidelity import attention_mask, fidelity_report, infer_kinds
from autotune.trial.guard import fidelity


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_an_embedding_with_large_relative_error_is_rejected_though_its_argmax_holds():
    ref = torch.randn(64, 32, generator=_gen())
    ref[:, 0] += 20.0  # one dominant dimension: the argmax never moves
    noisy = ref + 0.97 * ref.norm(dim=1, keepdim=True) * F.normalize(torch.randn(64, 32, generator=_gen(1)), dim=1)
    assert (noisy.argmax(1) == ref.argmax(1)).all()
    assert fidelity(noisy, ref) < 0.8  # its direction moved: rejected whatever the tolerance
    leaf = fidelity_report(noisy, ref)[0]
    assert leaf["kind"] == "embedding" and leaf["rel_mean"] == pytest.approx(0.97, abs=1e-3)
    assert fidelity(ref * 1.001, ref) > 0.99  # a tiny change of length is kept
    assert fidelity(ref * 1.5, ref) <= 0.5  # the length is judged too


def _regression(n: int, seed: int = 0) -> torch.Tensor:
    return 300.0 + 5.0 * torch.randn(n, generator=_gen(seed))  # a big offset every sample shares


def test_scalar_outputs_pulled_toward_their_mean_are_rejected_despite_a_big_shared_offset():
    ref = _regression(128)
    center = ref.mean()
    shrunk = center + 0.5 * (ref - center)  # half of what tells the samples apart is gone
    assert fidelity(shrunk, ref) < 0.6
    assert fidelity(shrunk[:, None], ref[:, None]) < 0.6  # (n, 1) is one value per sample too
    leaf = fidelity_report(shrunk, ref)[0]
    assert leaf["rel_mean"] == pytest.approx(0.5, rel=1e-6)  # error over the spread, not the magnitude


def test_scalar_outputs_with_small_noise_are_kept():
    ref = _regression(128)
    noisy = ref + 0.002 * ref.std() * torch.randn(128, generator=_gen(1))  # bf16-sized noise on the spread
    assert fidelity(noisy, ref) > 0.99
    assert fidelity(ref + 0.01, ref) > 0.99  # a shift far below the spread


def test_vectors_pulled_toward_their_mean_are_rejected_despite_a_big_shared_offset():
    ref = torch.randn(128, 16, generator=_gen()) + 1000.0 * torch.randn(16, generator=_gen(1))
    center = ref.mean(0, keepdim=True)
    shrunk = center + 0.5 * (ref - center)  # every centred direction kept, half its length gone
    assert fidelity(shrunk, ref) < 0.6
    assert fidelity_report(shrunk, ref)[0]["spread"] == pytest.approx(0.5)


def test_vectors_with_small_noise_and_a_big_shared_offset_are_kept():
    ref = torch.randn(128, 16, generator=_gen()) + 1000.0 * torch.randn(16, generator=_gen(1))
    noisy = ref + 1e-3 * torch.randn(128, 16, generator=_gen(2))
    assert fidelity(noisy, ref) > 0.99


def test_a_two_class_output_with_small_noise_near_ties_is_kept():
    base = torch.randn(256, 1, generator=_gen())
    ref = torch.cat([base, base + 1e-3 * torch.randn(256, 1, generator=_gen(1))], dim=1)  # near ties
    noisy = ref * (1 + 1e-3 * torch.randn(256, 2, generator=_gen(2)))
    assert (noisy.argmax(1) != ref.argmax(1)).float().mean() > 0.1  # many raw flips
    assert fidelity(noisy, ref, ["logits"]) >= 0.99


def test_real_flips_of_confident_logits_are_counted():
    ref = torch.tensor([[3.0, 0.0]] * 3 + [[0.0, 3.0]])
    out = ref.clone()
    out[0] = torch.tensor([0.0, 3.0])
    leaf = fidelity_report(out, ref, ["logits"])[0]
    assert leaf["top1"] == pytest.approx(0.75)
    assert leaf["score"] == pytest.approx(min(0.75, 1 - leaf["tv_mean"]))


def test_one_ruined_output_among_many_rejects_the_candidate():
    ref = {f"out{i}": torch.randn(32, 8, generator=_gen(i)) for i in range(12)}
    out = {k: v.clone() for k, v in ref.items()}
    out["out7"] = torch.randn(32, 8, generator=_gen(99))
    report = fidelity_report(out, ref)
    assert min(report, key=lambda r: r["score"])["name"] == "out7"
    assert fidelity(out, ref) < 0.5  # the mean of the 12 would be above 0.9


def test_integer_outputs_need_exact_agreement():
    ref = torch.arange(10)
    assert fidelity(ref.clone(), ref) == 1.0
    assert fidelity(torch.where(ref == 3, 0, ref), ref) == pytest.approx(0.9)


def test_token_outputs_are_judged_on_real_positions_only():
    samples = [{"input_ids": torch.zeros(4, dtype=torch.long), "attention_mask": torch.tensor([1, 1, 0, 0])}] * 3
    mask = attention_mask(samples)
    ref = torch.randn(3, 4, 8, generator=_gen())
    out = ref.clone()
    out[:, 2:] = torch.randn(3, 2, 8, generator=_gen(5))  # garbage where the padding is
    assert fidelity(out, ref, mask=mask) == pytest.approx(1.0)
    assert fidelity(out, ref) < 0.5


def test_logits_are_inferred_from_integer_targets_or_a_cross_entropy_loss_only():
    outputs = torch.randn(8, 4)
    labelled = [(torch.randn(3), torch.tensor(i % 4)) for i in range(8)]
    unlabelled = [torch.randn(3) for _ in range(8)]
    assert infer_kinds(outputs, labelled) == ["logits"]
    assert infer_kinds(outputs, unlabelled) == ["embedding"]
    assert infer_kinds(outputs, unlabelled, loss_fn=F.cross_entropy) == ["logits"]
    assert infer_kinds({"a": outputs, "b": outputs}, unlabelled, {"b": "logits"}) == ["embedding", "logits"]
    # targets that cannot index the classes are not evidence
    assert infer_kinds(outputs, [(torch.randn(3), torch.tensor(7))] * 8) == ["embedding"]


@pytest.mark.parametrize("bad", ["logit", ["logits", "nope"], 3])
def test_an_unknown_output_kind_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"output kind|output_kind"):
        infer_kinds(torch.randn(8, 4), [], bad)


def test_an_output_kind_list_must_name_every_output():
    with pytest.raises(ConfigError, match="one per tensor"):
        infer_kinds((torch.randn(8, 4), torch.randn(8, 2)), [], ["logits"])
