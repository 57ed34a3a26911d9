"""CUDA-graph compile modes replay one captured batch size: a short batch is padded to it."""

import pytest
import torch

from autotune.knobs.compiler import PaddedToCaptured


class _Sizes(torch.nn.Module):
    """A linear layer that records the batch sizes it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> dict:
        self.seen.append(x.shape[0])
        out = self.linear(x)
        return {"logits": out if scale is None else out * scale, "pooled": out.sum(-1)}


def test_a_short_batch_is_padded_to_the_captured_size_and_its_padded_rows_dropped():
    inner = _Sizes()
    wrapped = PaddedToCaptured(inner, 8)
    x = torch.randn(3, 4)
    out = wrapped(x, scale=torch.full((3, 1), 2.0))
    assert inner.seen == [8]  # the graph's one shape
    expected = inner.linear(x) * 2.0
    assert out["logits"].shape == (3, 3) and torch.allclose(out["logits"], expected)
    assert out["pooled"].shape == (3,)
    wrapped(torch.randn(8, 4))
    assert inner.seen == [8, 8]
    assert wrapped._orig_mod is inner  # unwrap() finds the user's module under it


class _StaticOutput(torch.nn.Module):
    """Writes every call's output into one buffer, as a CUDA graph's replay does."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = torch.zeros(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buffer[: x.shape[0]] = x[:, :2] * 2
        return self.buffer if x.shape[0] == self.buffer.shape[0] else self.buffer[: x.shape[0]]


@pytest.mark.parametrize("captured", [4, None])
def test_outputs_kept_across_calls_are_each_calls_own(captured):
    # predict keeps each batch's outputs: a replay must not rewrite the ones already returned
    wrapped = PaddedToCaptured(_StaticOutput(), captured)
    batches = [torch.full((4, 3), float(i)) for i in range(3)]
    kept = [wrapped(b) for b in batches]
    for i, out in enumerate(kept):
        assert torch.equal(out, torch.full((4, 2), 2.0 * i))


@pytest.mark.gpu
@pytest.mark.slow
def test_reduce_overhead_runs_an_epochs_short_last_batch_without_a_new_graph():
    from autotune.config import Config
    from autotune.trial.build import build

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    state = build(model, Config({"batch_size": 8, "compile_mode": "reduce-overhead"}), "cuda")
    assert isinstance(state.model, PaddedToCaptured)
    data = torch.randn(20, 16, device="cuda")
    import torch._dynamo.utils as dynamo_utils

    with torch.inference_mode():
        full = [state.model(data[i : i + 8]) for i in range(0, 16, 8)]
        frames = dynamo_utils.counters["frames"]["total"]
        last = state.model(data[16:])
        assert dynamo_utils.counters["frames"]["total"] == frames  # no recompile for the short batch
        reference = model.cuda()(data)
    got = torch.cat([*full, last])
    assert got.shape == (20, 4) and torch.allclose(got, reference, atol=1e-4)
