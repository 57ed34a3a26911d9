"""INT8 quantization: every CPU path runs, agrees with float32, and ships smaller."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

import autotune.compress.quantize as _quantize
from autotune.errors import ConfigError, TrialError


class MLP(nn.Module):
    """Linear 256-512-512-10 (also used by tests/compress/test_compression.py)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(64, 128, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, time, 64) -> logits of the last step, (batch, 10)
        return self.head(self.lstm(x)[0][:, -1])


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    ).eval()


def _agreement(a: nn.Module, b: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (a(x).argmax(1) == b(x).argmax(1)).float().mean().item()


def _size_ratio(quantized: nn.Module, reference: nn.Module) -> float:
    return _quantize.serialized_bytes(quantized) / _quantize.serialized_bytes(reference)


def _calibration(n: int = 4, batch: int = 16) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 1, 8, 8, generator=gen), torch.zeros(batch, dtype=torch.long)) for _ in range(n)]


@pytest.mark.parametrize(
    ("factory", "shape", "n_layers"), [(MLP, (512, 256), 3), (LSTMClassifier, (256, 12, 64), 2)], ids=["mlp", "lstm"]
)
def test_int8_dynamic_cpu_agrees_and_shrinks(factory, shape, n_layers):
    reference = factory().eval()
    quantized, info = _quantize.quantize(copy.deepcopy(reference), "int8_dynamic", "cpu", [], example=None)
    assert info["method"] == "int8_dynamic" and info["n_quantized"] == n_layers
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    assert _agreement(quantized, reference, x) >= 0.95
    assert _size_ratio(quantized, reference) <= 0.35


@pytest.fixture(scope="module")
def static_cnn():
    reference = _cnn()
    calibration = _calibration()
    quantized, info = _quantize.quantize(
        copy.deepcopy(reference), "int8_static", "cpu", calibration, example=calibration[0]
    )
    return reference, quantized, info


def test_int8_static_runs_at_any_batch_size(static_cnn):
    reference, quantized, info = static_cnn
    assert info == {"method": "int8_static", "backend": "x86_inductor", "n_quantized": 3}
    assert isinstance(quantized, torch.fx.GraphModule)
    x = torch.randn(37, 1, 8, 8, generator=torch.Generator().manual_seed(3))  # example batch was 16
    assert _agreement(quantized, reference, x) >= 0.90
    assert quantized(x[:1]).shape == (1, 10)
    assert nn.Sequential(quantized).eval()[0] is quantized  # wrappers call .eval() on it


def test_int8_static_ships_int8_weights_only(static_cnn):
    reference, quantized, _ = static_cnn
    assert _size_ratio(quantized, reference) <= 0.40
    assert not any(p.dtype == torch.float32 and p.dim() > 1 for p in quantized.state_dict().values())


def test_int8_static_dict_batch_of_one():
    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 4)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.linear(features)

    torch.manual_seed(0)
    example = {"features": torch.randn(1, 32), "label": torch.zeros(1, dtype=torch.long)}
    quantized, info = _quantize.quantize(Keyword().eval(), "int8_static", "cpu", [example], example=example)
    assert info["n_quantized"] == 1
    assert quantized(features=torch.randn(5, 32)).shape == (5, 4)


def test_int8_static_token_model_runs_at_every_sequence_width():
    # Calibrated on batches 16 tokens wide, then fed trimmed batches of other widths.
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            self.linear = nn.Linear(32, 4)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.linear(self.embed(input_ids)) * attention_mask.unsqueeze(-1)
            return hidden.sum(1)

    torch.manual_seed(0)
    calibration = [{"input_ids": torch.randint(0, 50, (4, 16)), "attention_mask": torch.ones(4, 16, dtype=torch.long)}]
    quantized, _ = _quantize.quantize(Tokens().eval(), "int8_static", "cpu", calibration, example=calibration[0])
    for width in (5, 16, 23):
        ids = torch.randint(0, 50, (3, width))
        assert quantized(input_ids=ids, attention_mask=torch.ones_like(ids)).shape == (3, 4)


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")
@pytest.mark.filterwarnings("ignore:To copy construct from a tensor:UserWarning")  # inside inductor
def test_int8_static_compiles(static_cnn):
    import torch._inductor.config

    reference, quantized, _ = static_cnn
    compiled = torch.compile(quantized, dynamic=False)
    gen = torch.Generator().manual_seed(4)
    # The int8 kernels need frozen weights, and Dynamo reads `freezing` from the global config
    # when it traces (torch.compile(options={"freezing": True}) alone fails in qconv_prepack).
    # Static shapes: a dynamic batch breaks the int8 conv kernels' stride checks in torch 2.13.
    with torch._inductor.config.patch(freezing=True), torch.no_grad():
        for batch in (16, 5):
            assert compiled(torch.randn(batch, 1, 8, 8, generator=gen)).shape == (batch, 10)
        assert _agreement(compiled, reference, torch.randn(64, 1, 8, 8, generator=gen)) >= 0.90


@pytest.mark.parametrize("method", ["int8_dynamic", "int8_static"])
def test_nothing_to_quantize_is_unsupported(method):
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU()).eval() if method == "int8_dynamic" else nn.ReLU()
    example = torch.randn(2, 1, 8, 8)
    with pytest.raises(TrialError) as info:
        _quantize.quantize(model, method, "cpu", [example], example=example)
    assert info.value.kind == "unsupported"


def test_export_failure_is_unsupported():
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0].sum().reshape(1).repeat(int(x.sum().item() > 0) + 1)

    example = torch.randn(4, 8)
    with pytest.raises(TrialError, match="failed") as info:
        _quantize.quantize(DataDependent(), "int8_static", "cpu", [example], example=example)
    assert info.value.kind == "unsupported"


def test_offered_on_cpu(cpu_env):
    assert _quantize.offered("none", cpu_env) is None
    assert _quantize.offered("int8_dynamic", cpu_env) is None
    assert _quantize.offered("int8_static", cpu_env) is None  # this test machine is x86
    assert "slower than float32 on CPU" in _quantize.offered("int8_weight_only", cpu_env)
    # It shrinks the weights as dynamic int8 does while activations stay float: offered for size.
    assert _quantize.offered("int8_weight_only", cpu_env, ("size", "latency")) is None
    assert _quantize.offered("int8_weight_only", cpu_env, ("memory",)) is None
    with pytest.raises(ConfigError, match="Known: none, int8_dynamic"):
        _quantize.offered("int4", cpu_env)


def test_the_search_offers_weight_only_on_cpu_for_size_only(cpu_env):
    from autotune.data import describe
    from autotune.knobs import SpaceContext, get_knob

    data = describe([torch.zeros(256)] * 4)
    fast = get_knob("quantization").offer(SpaceContext(cpu_env, data, 32, objectives=("throughput",)))
    small = get_knob("quantization").offer(SpaceContext(cpu_env, data, 32, objectives=("size", "latency")))
    assert "int8_weight_only" not in fast.values and "slower" in fast.excluded["int8_weight_only"]
    assert "int8_weight_only" in small.values


def test_weight_only_and_per_channel_on_cpu():
    reference = MLP().eval()
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    quantized, info = _quantize.quantize(copy.deepcopy(reference), "int8_weight_only", "cpu", [], example=x[:2])
    assert info == {"method": "int8_weight_only", "backend": "torchao", "n_quantized": 3}
    assert _agreement(quantized, reference, x) >= 0.95
    assert _size_ratio(quantized, reference) <= 0.35
    per_channel, _ = _quantize.quantize(
        copy.deepcopy(reference), "int8_dynamic", "cpu", [], example=None, per_channel=True
    )
    assert per_channel.net[0].weight().qscheme() == torch.per_channel_affine
    assert _agreement(per_channel, reference, x) >= 0.95


@pytest.mark.parametrize("method", ["int8_dynamic", "int8_weight_only", "int8_static"])
def test_only_the_layers_named_are_quantized(method):
    reference = MLP().eval()
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4))
    quantized, info = _quantize.quantize(copy.deepcopy(reference), method, "cpu", [x], example=x, layers=["net.2"])
    assert info["n_quantized"] == 1
    everything, _ = _quantize.quantize(copy.deepcopy(reference), method, "cpu", [x], example=x)
    # net.2 is 512x512 of the 256x512 + 512x512 + 512x10 weights: about half the bytes go int8.
    assert _size_ratio(everything, reference) < _size_ratio(quantized, reference) < 0.75
    assert _agreement(quantized, reference, x) >= 0.95
    with pytest.raises(TrialError, match="found no"):
        _quantize.quantize(copy.deepcopy(reference), method, "cpu", [x], example=x, layers=["net.1"])


def test_none_returns_the_model():
    model = MLP().eval()
    assert _quantize.quantize(model, "none", "cpu", [], example=None) == (
        model,
        {"method": "none", "backend": None, "n_quantized": 0},
    )


def test_serialized_bytes_counts_torchao_and_compiled_wrappers():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    reference = MLP().eval()
    quantized = copy.deepcopy(reference)
    quantize_(quantized, Int8WeightOnlyConfig())  # runs on CPU too, only slowly
    assert _size_ratio(quantized, reference) <= 0.35
    assert _quantize.serialized_bytes(torch.compile(reference)) == _quantize.serialized_bytes(reference)
    assert len(_quantize.serialized_bytes(quantized, raw=True)) == _quantize.serialized_bytes(quantized)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["int8_dynamic", "int8_weight_only"])
def test_torchao_cuda(method):
    from autotune.env import Env

    env = Env.detect("cuda")
    assert _quantize.offered(method, env) is None
    assert "CPUs only" in _quantize.offered("int8_static", env)
    reference = MLP().eval().cuda()
    quantized, info = _quantize.quantize(copy.deepcopy(reference), method, env.device, [], example=None)
    assert info == {"method": method, "backend": "torchao", "n_quantized": 3}
    x = torch.randn(512, 256, device=env.device, generator=torch.Generator(env.device).manual_seed(2))
    assert _agreement(quantized, reference, x) >= 0.95
    assert _size_ratio(quantized, reference) <= 0.35


def test_int8_dynamic_transformer_runs_without_the_float_fast_path():
    from torch.utils.data import default_collate

    from autotune.data import model_inputs
    from tests.models import TinyEncoder, token_data

    batch = default_collate(token_data(8))
    model, info = _quantize.quantize(TinyEncoder().eval(), "int8_dynamic", "cpu", [], example=batch)
    args, kwargs = model_inputs(batch)
    with torch.inference_mode():
        assert model(*args, **kwargs).shape == (8, 4)
    assert info["n_quantized"] >= 4 and torch.backends.mha.get_fastpath_enabled()  # restored afterwards
