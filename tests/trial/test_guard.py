"""The accuracy guard: fidelity by default, the user's metric when given."""

import json

import pytest
import torch

import autotune
from autotune.data import validation_indices
from autotune.trial.guard import fidelity
from tests.models import MLP, TinyEmbedder, WrongButFastUnderAutocast, classification_data, sentence_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}


class SinkEmbedder(TinyEmbedder):
    """A :class:`TinyEmbedder` whose output projection reads a hidden state with one massive
    channel that carries no meaning (an attention sink, as real encoders have): the projection
    ignores it, but ONNX Runtime's dynamic int8 quantizes the projection's input with one scale
    per tensor, set by that channel, which rounds every other channel to a few steps. The damage
    is in the quantized inputs, so it is the same on every CPU (AVX2's u8 x s8 saturation only
    adds to it, VNNI and AMX do not take it away)."""

    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(64, 64)
        with torch.no_grad():
            self.project.weight[:, 0] = 0.0
        self.register_buffer("sink", torch.eye(64)[0] * 100.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.project(super().forward(input_ids, attention_mask) + self.sink) + self.outlier


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_an_int8_embedding_model_that_loses_its_geometry_is_infeasible_under_the_default_guard(tmp_path):
    pytest.importorskip("onnxruntime")
    result = autotune.optimize(
        SinkEmbedder(),
        sentence_data(),
        space={"base": None},
        # Every layer in int8: a fallback that keeps the damaged layer float would pass, rightly.
        fix={"runtime": "onnxruntime", "ort_precision": "int8_dynamic", "int8_fallback": 0, "int8_per_channel": False},
        out_dir=tmp_path,
        baseline_batch_size=16,
        measure=FAST,
        n_verify_pairs=1,
        n_trials=2,
        device="cpu",
        isolation="inprocess",
        export=(),
    )
    int8 = next(t for t in result.study.trials if t.user_attrs["config"]["runtime"] == "onnxruntime")
    attrs = int8.user_attrs
    # Its argmax never moves (one dominant dimension), so top-1 agreement would pass it at 1.0.
    assert attrs["status"] == "infeasible" and attrs["kind"] == "guard", attrs
    assert attrs["metric_drop"] > 0.02
    assert result.best_config["runtime"] == "torch"


class ShrinksAtLargeBatches(torch.nn.Module):
    """A regression model with a big shared offset, ``300 + 5 * linear(x)``, whose outputs are
    pulled halfway to the batch's mean at batch sizes above 8 (as a stray batch statistic does)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = 300.0 + 5.0 * self.linear(x)[:, 0]
        if x.shape[0] > 8:
            y = y.mean() + 0.5 * (y - y.mean())
        return y


def test_a_regression_candidate_that_shrinks_its_outputs_toward_their_mean_is_infeasible(tmp_path):
    torch.manual_seed(0)
    data = [(x, torch.tensor(0.0)) for x in torch.randn(128, 16, generator=torch.Generator().manual_seed(0))]
    result = autotune.optimize(
        ShrinksAtLargeBatches(),
        data,
        space={"base": None},
        fix={"batch_size": 32},
        out_dir=tmp_path,
        baseline_batch_size=8,
        measure=FAST,
        n_verify_pairs=1,
        n_trials=2,
        device="cpu",
        isolation="inprocess",
        export=(),
    )
    shrunk = next(t for t in result.study.trials if t.user_attrs["config"]["batch_size"] == 32).user_attrs
    # Its values keep the shared offset to within 1%: judged against their magnitude, it passed.
    assert shrunk["status"] == "infeasible" and shrunk["kind"] == "guard", shrunk
    assert shrunk["metric_drop"] > 0.3
    assert result.best_config["batch_size"] == 8


def test_fidelity_scores_top1_agreement_for_logits():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert fidelity(ref.clone(), ref, ["logits"]) == 1.0
    flipped = ref.clone()
    flipped[0] = torch.tensor([0.0, 1.0])
    assert fidelity(flipped, ref, ["logits"]) == pytest.approx(0.75)


def test_fidelity_scores_relative_error_for_other_outputs():
    ref = torch.ones(10)
    assert fidelity(ref * 1.001, ref) == pytest.approx(0.999, abs=1e-6)
    assert fidelity(ref * 3, ref) == 0.0


def accuracy(outputs, batch):
    return (outputs.argmax(1) == batch[1]).float().mean().item()


@pytest.mark.parametrize(
    "metric",
    [pytest.param(None, marks=pytest.mark.slow), accuracy],  # CI time: fidelity's guard is tested on its own
    ids=["fidelity", "user-metric"],
)
def test_guard_rejects_a_destructive_candidate_even_when_it_is_fastest(tmp_path, cpu_env, metric):
    if not cpu_env.bf16:
        pytest.skip("bfloat16 autocast is not offered on this CPU")
    result = autotune.optimize(
        WrongButFastUnderAutocast(),
        classification_data(),
        space={"base": None, "amp_dtype": "all"},
        metric=metric,
        out_dir=tmp_path,
        baseline_batch_size=8,
        n_val=64,
        measure=FAST,
        n_verify_pairs=1,
        n_trials=2,
        device="cpu",
    )
    wrong = next(t for t in result.study.trials if t.user_attrs["config"]["amp_dtype"] == "bfloat16")
    attrs = wrong.user_attrs
    assert attrs["status"] == "infeasible" and attrs["kind"] == "guard"
    assert attrs["metric_drop"] > 0.01
    # Its measured numbers are kept: the guard, not a failed measurement, excluded it. Whether
    # bf16 is faster than fp32 depends on the CPU (AMX, bf16 units or emulation), so not asserted.
    assert attrs["samples_per_s"] > 0
    assert wrong.constraints["metric_drop"] > 0
    assert result.best_config["amp_dtype"] == "float32"


def test_baseline_metric_is_the_users_metric(tmp_path):
    result = autotune.optimize(
        MLP(),
        classification_data(),
        space={"base": None, "batch_size": [8]},
        metric=accuracy,
        out_dir=tmp_path,
        baseline_batch_size=8,
        measure=FAST,
        n_trials=1,
        device="cpu",
        isolation="inprocess",
    )
    data = classification_data()
    # The guard scores the validation subset (a small dataset keeps some samples out of it, for
    # calibration): the user's metric on exactly those samples.
    n_val = json.loads((tmp_path / "best_config.json").read_text())["guard"]["n_val"]
    model = MLP().eval()
    with torch.no_grad():
        val = [data[i] for i in validation_indices(len(data), n_val)]
        expected = sum(int(model(x[None]).argmax(1) == y) for x, y in val) / len(val)
    assert result.baseline["metric"] == pytest.approx(expected, abs=1e-6)
    assert result.baseline["metric_drop"] == 0.0


class TinyQA(torch.nn.Module):
    """Question answering's shape: ``(start_logits, end_logits)``, each ``(batch, seq)``, from
    tokens mixed with the mean of the real ones (so padding changes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(100, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed(input_ids)
        keep = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * keep).sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp_min(1.0)
        logits = self.head(torch.tanh(hidden + pooled))
        return logits[..., 0], logits[..., 1]


def qa_data(n: int = 96, padded: bool = True) -> list:
    """Token samples of 3 to 24 real tokens, right-padded to 24 positions or at their own length."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        mask = torch.zeros(24, dtype=torch.long)
        mask[: 3 + (i * 7) % 22] = 1
        ids = torch.randint(1, 100, (24,), generator=gen) * mask
        width = 24 if padded else int(mask.sum())
        samples.append({"input_ids": ids[:width], "attention_mask": mask[:width]})
    return samples


def _qa_run(tmp_path, metric=None, padded=True):
    return autotune.optimize(
        TinyQA(),
        qa_data(padded=padded),
        space={"base": None},
        fix={"padding": "trim", "length_grouping": 4},
        metric=metric,
        out_dir=tmp_path,
        baseline_batch_size=8,
        measure=FAST,
        n_verify_pairs=1,
        n_trials=2,
        device="cpu",
        isolation="inprocess",
        export=(),
    )


def _trimmed(result):
    return next(t for t in result.study.trials if t.user_attrs["config"]["padding"] == "trim").user_attrs


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "own-length"])
def test_per_token_start_and_end_logits_of_a_trimmed_and_grouped_candidate_keep_the_guard(tmp_path, padded):
    result = _qa_run(tmp_path, padded=padded)
    trimmed = _trimmed(result)
    # Cut to each sample's real tokens, its logits are the baseline's; judged as whole rows of the
    # batch's width, every trimmed or reordered batch failed.
    assert trimmed["status"] == "ok", trimmed
    assert trimmed["metric_drop"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_a_metric_gets_per_token_outputs_as_wide_as_the_batch_it_is_given(tmp_path):
    widths = []

    def start_confidence(outputs, batch):
        start, end = outputs
        mask = batch["attention_mask"].bool()
        if start.shape != mask.shape or end.shape != mask.shape:
            raise ValueError(f"outputs {tuple(start.shape)} for a batch of {tuple(mask.shape)}")
        widths.append(start.shape[1])
        probs = start.masked_fill(~mask, float("-inf")).softmax(1)
        return probs.max(1).values.mean().item()

    # Samples at their own lengths: each metric batch is padded to its own longest sample.
    result = _qa_run(tmp_path, start_confidence, padded=False)
    trimmed = _trimmed(result)
    assert trimmed["status"] == "ok", trimmed
    assert trimmed["metric_drop"] == pytest.approx(0.0, abs=1e-6)
    assert len(set(widths)) > 1


def test_only_outputs_whose_width_follows_the_batch_are_per_token():
    from autotune.batching import pad_collate, token_outputs

    batch = pad_collate(qa_data(8))
    assert batch["attention_mask"].shape == (8, 24)
    qa, pooled = TinyQA().eval(), torch.nn.Linear(8, 24)

    def both(b):  # start and end logits, and a 24-wide vector of the same width as the batch
        start, end = qa(**b)
        return {"start": start, "vector": pooled(qa.embed(b["input_ids"]).mean(1)), "end": end}

    with torch.inference_mode():
        assert token_outputs(both, batch) == (0, 2)


def test_the_guard_runs_every_batch_at_the_configurations_size_so_a_compile_builds_once():
    """225 validation sentences in batches of 32 left one of 1: a compile with shapes as symbols
    built again for it (a size of 1 is never a symbol), 20 s of a guard a user never pays. A
    short batch is padded to full size and its outputs cut back, sample by sample the same."""
    from autotune.batching import pad_collate
    from autotune.config import Config
    from autotune.knobs.state import BuildExtras
    from autotune.trial.build import build
    from autotune.trial.guard import collect_per_sample

    class Recorder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.sizes = torch.nn.Embedding(50, 3), []

        def forward(self, input_ids, attention_mask):
            self.sizes.append(input_ids.shape[0])
            return self.embed(input_ids) * attention_mask.unsqueeze(-1)

    samples = []
    for n in [3, 7, 2, 5, 6, 1, 4, 7, 3]:  # 9 samples in batches of 4: one of 1
        ids = torch.zeros(8, dtype=torch.long)
        ids[:n] = torch.arange(1, n + 1)
        samples.append({"input_ids": ids, "attention_mask": (ids > 0).long()})
    extras = BuildExtras(example=pad_collate(samples[:4]), collate_fn=pad_collate, lengths=[3, 7, 2, 5, 6, 1, 4, 7, 3])
    config = Config({"batch_size": 4, "padding": "trim", "length_grouping": 4})
    model = Recorder()
    state = build(model, config, "cpu", extras=extras, copy_model=False)
    outputs, _ = collect_per_sample(state, samples)
    assert model.sizes and set(model.sizes) == {4}
    # Each sample's outputs are its own, whatever it was batched with.
    for i, sample in enumerate(samples):
        n = int(sample["attention_mask"].sum())
        assert torch.equal(outputs[i, :n], model.embed(sample["input_ids"][:n]))
