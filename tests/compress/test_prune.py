"""Pruning on tiny models: structured (a CNN and a transformer), unstructured, 2:4, fine-tuning."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autotune.compress.prune as _prune
from autotune.errors import ConfigError, TrialError
from tests.models import MLP, classification_data


class ConvNet(nn.Module):
    """Conv-BN-ReLU x2 and a Linear head on (3, 16, 16) images."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class TokenClassifier(nn.Module):
    """Token ids (batch, 16) -> 2-layer TransformerEncoder -> mean pool -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 64)
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 5)

    def forward(self, ids: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=padding_mask).mean(1))


def _images() -> tuple[tuple, dict]:
    return (torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)),), {}


def _tokens(mask: bool) -> tuple[tuple, dict]:
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    if not mask:
        return (ids,), {}
    padding = torch.zeros(4, 16, dtype=torch.bool)
    padding[1, 10:] = True  # one padded sequence
    return (ids,), {"padding_mask": padding}


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_count_macs_of_a_linear_layer():
    assert _prune.count_macs(nn.Linear(4, 2), (torch.zeros(3, 4),), {}) == (3 * 4 * 2, 4 * 2 + 2)


def test_count_macs_sees_through_the_transformer_fast_path():
    model = TokenClassifier().eval()
    args, kwargs = _tokens(mask=True)
    macs, _ = _prune.count_macs(model, args, kwargs)
    per_token_per_layer = 64 * 3 * 64 + 64 * 64 + 2 * 64 * 128  # qkv, out projection, feed-forward
    assert macs >= 4 * 16 * 2 * per_token_per_layer
    assert not model.training


def test_output_layers_walks_through_parameter_free_ops():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Softmax(-1))
    assert _prune.output_layers(net, (torch.zeros(1, 4),), {}) == [net[2]]
    model = TokenClassifier()
    assert _prune.output_layers(model, *_tokens(mask=False)) == [model.head]


def test_structured_cnn_is_smaller_and_keeps_its_output():
    model = ConvNet().eval()
    args, kwargs = _images()
    out_shape = model(*args).shape
    info = _prune.prune_structured_(model, args, kwargs, 0.5)
    assert info["macs_after"] <= 0.55 * info["macs_before"]
    assert info["params_after"] < info["params_before"]
    assert model.features[0].out_channels == 8 and model.features[1].num_features == 8
    assert model.head.out_features == 10
    assert model(*args).shape == out_shape
    assert not model.training


@pytest.mark.parametrize("mask", [False, True])
def test_structured_transformer_prunes_heads_consistently(mask):
    model = TokenClassifier().eval()
    args, kwargs = _tokens(mask)
    out_shape = model(*args, **kwargs).shape
    info = _prune.prune_structured_(model, args, kwargs, 0.5)
    assert info["macs_after"] <= 0.55 * info["macs_before"]
    assert model.embed.embedding_dim == 32 and model.head.in_features == 32 and model.head.out_features == 5
    for layer in model.encoder.layers:
        attn = layer.self_attn
        assert (attn.embed_dim, attn.num_heads, attn.head_dim) == (32, 4, 8)
        assert attn.in_proj_weight.shape == (96, 32) and layer.linear1.out_features == 64
    with torch.no_grad():  # eval + no_grad: the fused fast path runs the pruned layers
        assert model(*args, **kwargs).shape == out_shape
    model.train()
    assert model(*args, **kwargs).shape == out_shape


def test_structured_transformer_heads_keep_their_dims_together():
    model = TokenClassifier().eval()
    q_rows = model.encoder.layers[0].self_attn.in_proj_weight[:64].detach().clone()
    _prune.prune_structured_(model, *_tokens(mask=False), 0.5)
    kept = model.encoder.layers[0].self_attn.in_proj_weight[:32]
    # Every kept q row came from the same position within its head in every head.
    positions = [int((q_rows[:, :1] == row[:1]).nonzero()[0, 0]) % 16 for row in kept]
    assert positions[:8] * 4 == positions


def test_structured_keeps_ignored_modules_whole():
    model = ConvNet()
    before = _shapes(model)
    _prune.prune_structured_(model, *_images(), 0.5, ignore=["features.3"])
    after = _shapes(model)
    assert after["features.3.weight"] == before["features.3.weight"]
    assert after["head.weight"] == before["head.weight"]


def test_structured_is_deterministic():
    model = ConvNet()
    twin = copy.deepcopy(model)
    _prune.prune_structured_(model, *_images(), 0.3)
    _prune.prune_structured_(twin, *_images(), 0.3)
    assert _shapes(model) == _shapes(twin)


def test_structured_rejects_bad_arguments():
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        _prune.prune_structured_(ConvNet(), *_images(), 1.0)
    with pytest.raises(ConfigError, match="Known: features"):
        _prune.prune_structured_(ConvNet(), *_images(), 0.5, ignore=["nope"])


def test_unstructured_zeroes_half_of_the_weights_for_good():
    model = ConvNet()
    keys = list(model.state_dict())
    info = _prune.prune_unstructured_(model, 0.5)
    weights = [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    n_zero = sum(int((w == 0).sum()) for w in weights)
    assert info["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert n_zero == round(0.5 * sum(w.numel() for w in weights))
    assert list(model.state_dict()) == keys  # no weight_orig / weight_mask left behind
    assert not any(hasattr(m, "weight_mask") for m in model.modules())
    assert info["params_after"] == sum(int(p.count_nonzero()) for p in model.parameters())
    assert info["params_after"] <= info["params_before"] - n_zero


def test_unstructured_leaves_ignored_layers_dense():
    model = ConvNet()
    _prune.prune_unstructured_(model, 0.5, ignore=["head"])
    assert bool((model.head.weight != 0).all())


def test_finetune_recovers_a_pruned_mlp_and_keeps_zeros():
    data = classification_data(n=512)
    model = MLP()
    _prune.prune_structured_(model, (torch.zeros(2, 16),), {}, 0.5)
    _prune.prune_unstructured_(model, 0.3)
    zeros = model.net[0].weight == 0

    def loss_fn(outputs: torch.Tensor, batch: list) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, batch[1])

    info = _prune.finetune_(model, loss_fn, data, steps=150, batch_size=32, device="cpu", lr=1e-2)
    assert info["loss_last"] < info["loss_first"]
    assert bool((model.net[0].weight[zeros] == 0).all())
    assert not model.training


def test_2_4_needs_cuda():
    with pytest.raises(TrialError) as err:
        _prune.prune_2_4_(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)))
    assert err.value.kind == "unsupported"


@pytest.mark.gpu
def test_2_4_converts_linear_layers_on_cuda():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("2:4 sparse kernels need compute capability 8.0+")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 3))
    model = model.half().cuda().eval()
    reference = copy.deepcopy(model)
    for m in reference:
        if isinstance(m, nn.Linear) and m.out_features >= 128:
            m.weight.data *= _prune._mask_2_4(m.weight)
    info = _prune.prune_2_4_(model)
    assert info["n_layers"] == 2  # the (3, 128) head has too few rows for the kernels
    x = torch.randn(64, 128, device="cuda", dtype=torch.half)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-2, atol=1e-2)


def test_macs_count_cpu_attention_and_lstm_layers():
    # torch's FLOP counter has no CPU formulas for fused attention or the oneDNN LSTM layer.
    lstm = nn.LSTM(64, 128, batch_first=True)
    macs, _ = _prune.count_macs(lstm, (torch.randn(2, 12, 64),), {})
    assert macs == 2 * 12 * 4 * 128 * (64 + 128)


def test_fine_tuning_never_trains_on_the_samples_the_guard_scores(tmp_path):
    import json

    import torch.nn.functional as F

    import autotune
    from autotune.trial.extras import finetune_dataset
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.spec import WorkerSpec
    from tests.models import MLP, classification_data

    data = classification_data(200)  # fewer than n_val: the guard used to score all 200
    result = autotune.optimize(
        MLP(),
        data,
        space={"base": None, "batch_size": [8]},
        loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]),
        out_dir=tmp_path,
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=1,
        device="cpu",
        isolation="inprocess",
        export=(),
    )
    guard = json.loads((tmp_path / "best_config.json").read_text())["guard"]
    assert guard["n_val"] == 100 and guard["finetune_data"] == "dataset samples outside the validation subset"
    assert result.best_config is not None
    val = autotune.data.validation_indices(200, 100)
    spec = WorkerSpec(MLP(), data, None, "cpu", {}, val, MeasureSettings())
    train = finetune_dataset(spec)
    assert len(train) == 100 and not set(train.indices) & set(val)
