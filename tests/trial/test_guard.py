"""The accuracy guard: fidelity by default, the user's metric when given."""

import pytest
import torch

import autotune
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


def test_an_int8_embedding_model_that_loses_its_geometry_is_infeasible_under_the_default_guard(tmp_path):
    pytest.importorskip("onnxruntime")
    result = autotune.optimize(
        SinkEmbedder(),
        sentence_data(),
        space={"base": None},
        fix={"runtime": "onnxruntime", "ort_precision": "int8_dynamic"},
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


@pytest.mark.parametrize("metric", [None, accuracy], ids=["fidelity", "user-metric"])
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
    # Its measured numbers are kept, and it was faster: the guard, not speed, excluded it.
    assert attrs["samples_per_s"] > result.baseline["samples_per_s"]
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
    model = MLP().eval()
    with torch.no_grad():
        expected = sum(int(model(x[None]).argmax(1) == y) for x, y in data) / len(data)
    assert result.baseline["metric"] == pytest.approx(expected, abs=1e-6)
    assert result.baseline["metric_drop"] == 0.0
