"""apply() rebuilds a compressed winner in the user's own code."""

import collections
import dataclasses

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


@dataclasses.dataclass
class FakeModelOutput(collections.OrderedDict):
    """What a Hugging Face ``ModelOutput`` is: an OrderedDict dataclass whose keys are attributes."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def to_tuple(self):
        return tuple(self.values())


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        hidden = self.body(x)
        return FakeModelOutput(logits=self.head(hidden), hidden=hidden)


def test_apply_keeps_the_models_own_output_type():
    x = torch.randn(4, 16)
    tuned = autotune.apply(Classifier(), {"amp_dtype": "bfloat16", "channels_last": False})
    with torch.no_grad():
        out = tuned(x)
    assert type(out) is FakeModelOutput
    assert out.logits.shape == (4, 4) and out.logits.dtype == torch.float32 and out["hidden"] is out.hidden


def test_predict_with_a_batched_gather_gives_the_per_sample_outputs():
    from autotune.knobs.gather import GatheredDataset

    data = torch.utils.data.TensorDataset(torch.randn(21, 3, 8, 8), torch.arange(21))
    assert isinstance(autotune.dataloader(data, {"batch_size": 8, "gather": "batched"}).dataset, GatheredDataset)
    plain = autotune.predict(TinyCNN(), data, {"batch_size": 8}, device="cpu")
    fast = autotune.predict(TinyCNN(), data, {"batch_size": 8, "gather": "batched"}, device="cpu")
    assert len(fast) == 21
    torch.testing.assert_close(torch.stack(list(fast)), torch.stack(list(plain)), rtol=0, atol=0)


@pytest.mark.gpu
def test_the_tuned_loader_yields_batches_on_the_device_it_is_given():
    data = torch.utils.data.TensorDataset(torch.randn(20, 3, 8, 8), torch.arange(20))
    config = {"batch_size": 8, "gather": "batched", "pin_memory": True, "device_prefetch": True}
    loader = autotune.dataloader(data, config, device="cuda")
    assert len(loader) == 3 and loader.batch_size == 8
    batches = list(loader)
    assert all(x.is_cuda and y.is_cuda for x, y in batches)
    assert torch.equal(torch.cat([x for x, _ in batches]).cpu(), data.tensors[0])
    assert not next(iter(autotune.dataloader(data, config)))[0].is_cuda  # without a device: CPU batches
