"""apply() rebuilds a compressed winner in the user's own code."""

import pytest
import torch

import autotune
from tests.models import TinyCNN, image_data


def test_apply_rebuilds_a_pruned_and_quantized_model():
    data = image_data(64)
    fast = autotune.apply(TinyCNN(), {"prune_ratio": 0.5, "quantization": "int8_dynamic"}, device="cpu", dataset=data)
    x = torch.stack([s[0] for s in data[:4]])
    assert fast(x).shape == (4, 4)
    assert fast.model.conv.out_channels == 4  # 8 channels, half pruned


def test_apply_without_data_says_what_is_missing():
    with pytest.raises(autotune.ConfigError, match=r"pass dataset= to autotune\.apply"):
        autotune.apply(TinyCNN(), {"prune_ratio": 0.5}, device="cpu")
