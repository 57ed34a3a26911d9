"""A model that returns a dict gets a dict back from every runtime that ran it: the user's code
reads its outputs by key, whatever the winner runs on."""

import pytest
import torch
from torch import nn

import autotune
from autotune.config import Config
from autotune.export.keyed import KeyedOutputs, keyed


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"scores": self.a(h), "embedding": self.b(h)}


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_apply_gives_the_models_dict_back_from_a_runtime(runtime):
    if runtime == "openvino":
        pytest.importorskip("openvino")
    model = TwoHeads().eval()
    data = [(torch.randn(8), 0) for _ in range(32)]
    config = dict(Config({"runtime": runtime, "batch_size": 8}))
    fast = autotune.apply(model, config, dataset=data, device="cpu")
    batch = torch.stack([x for x, _ in data[:8]])
    out, own = fast(batch), model(batch)
    assert isinstance(out, dict) and list(out) == ["scores", "embedding"]
    for key in own:
        torch.testing.assert_close(out[key], own[key], atol=1e-4, rtol=1e-4)


def test_flat_names_are_left_flat_and_one_keyed_output_is_a_dict():
    class One(nn.Module):
        def forward(self, x):
            return x * 2

    assert keyed(One(), ["output"]).__class__ is One
    assert keyed(One(), ["output_0", "output_1"]).__class__ is One
    wrapped = keyed(One(), ["features"])
    assert isinstance(wrapped, KeyedOutputs) and list(wrapped(torch.ones(2))) == ["features"]
