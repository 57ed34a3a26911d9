"""TorchScript export (loaded back in a fresh process), its fallback, and export_artifacts'
bookkeeping: failed exports and failed parity are recorded, never raised."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from autotune.errors import ConfigError, ExportError
from autotune.export import file_digest
from autotune.export.torchscript import export_torchscript
from autotune.runtimes.artifacts import export_artifacts
from tests.models import MLP, ItemBranch, SmallCNN


class Scorer(nn.Module):
    """Two keyword inputs, dict output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 3)

    def forward(self, features: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.linear(features) * weight[:, None]
        return {"logits": logits, "probs": logits.softmax(-1)}


class WithNote(SmallCNN):
    """Returns a string beside its logits, which the tracer refuses."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        return super().forward(x), "note"


@torch.library.custom_op("autotune_test_ts::shift", mutates_args=())
def _shift(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@_shift.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CustomOp(SmallCNN):
    """An operator neither ONNX exporter can translate, which TorchScript records as a call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _shift(super().forward(x))


def _images(n: int = 24) -> list:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 8, 8, generator=gen), torch.tensor(i % 4)) for i in range(n)]


_LOAD_AND_RUN = """
import sys
import numpy as np
import torch
module = torch.jit.load(sys.argv[1])
with torch.no_grad():
    out = module(torch.from_numpy(np.load(sys.argv[2])))
np.save(sys.argv[3], out.numpy())
"""


def test_artifact_loads_in_a_fresh_process_and_matches(tmp_path):
    model = SmallCNN().eval()
    samples = _images()
    info = export_torchscript(model, default_collate(samples[:8]), tmp_path / "model.pt")
    assert info["form"] == "tuned" and info["frozen"] and info["reason"] is None
    x = torch.stack([s[0] for s in samples[:5]])  # another batch size than the traced one
    np.save(tmp_path / "x.npy", x.numpy())
    argv = [
        sys.executable,
        "-c",
        _LOAD_AND_RUN,
        str(tmp_path / "model.pt"),
        str(tmp_path / "x.npy"),
        str(tmp_path / "y.npy"),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with torch.no_grad():
        np.testing.assert_allclose(np.load(tmp_path / "y.npy"), model(x).numpy(), rtol=1e-4, atol=1e-5)


def test_an_mlp_ships_frozen_and_optimized_as_the_bytes_that_were_loaded_and_checked(tmp_path):
    """The file is the module optimize_for_inference made from the frozen copy the freeze check
    loaded, written as the bytes that were loaded again and checked: a copy it could not take
    would leave the artifact unoptimized, and saved bytes that did not load would fail here."""
    model, x = MLP().eval(), torch.randn(8, 16)
    info = export_torchscript(model, x, tmp_path / "model.pt")
    assert info["form"] == "tuned" and info["frozen"] and info["optimized"]
    loaded = torch.jit.load(str(tmp_path / "model.pt"))
    y = torch.randn(3, 16)  # another batch size than the traced one
    with torch.no_grad():
        torch.testing.assert_close(loaded(y), model(y), rtol=1e-4, atol=1e-5)


def test_keyword_inputs_and_dict_outputs_are_traced_by_name(tmp_path):
    model = Scorer().eval()
    batch = {"features": torch.randn(4, 6), "weight": torch.rand(4), "label": torch.zeros(4)}
    info = export_torchscript(model, batch, tmp_path / "model.pt")
    assert info["input_names"] == ["features", "weight"]
    loaded = torch.jit.load(str(tmp_path / "model.pt"))
    x, w = torch.randn(3, 6), torch.rand(3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(features=x, weight=w)["probs"], model(x, w)["probs"])


def test_untraceable_model_exports_its_fallback_or_raises(tmp_path):
    example = default_collate(_images(4))
    with pytest.raises(ExportError, match="Pass `fallback=`"):
        export_torchscript(WithNote().eval(), example, tmp_path / "model.pt")
    info = export_torchscript(WithNote().eval(), example, tmp_path / "model.pt", fallback=SmallCNN().eval())
    assert info["form"] == "fallback" and "Only tensors" in info["reason"]


def test_failed_export_is_recorded_and_the_other_format_still_ships(tmp_path):
    model = CustomOp().eval()
    samples = _images()
    out = export_artifacts(model, default_collate(samples[:8]), samples, 8, tmp_path, ["onnx", "torchscript"])
    assert out["onnx"]["status"] == "failed" and "autotune_test_ts" in out["onnx"]["error"]
    assert not (tmp_path / "model.onnx").exists()
    ts = out["torchscript"]
    assert ts["status"] == "ok" and ts["parity"]["ok"] and ts["parity"]["max_abs"] == 0.0
    assert ts["path"] == "model.pt" and ts["bytes"] == (tmp_path / "model.pt").stat().st_size
    assert ts["sha256"] == file_digest(tmp_path / "model.pt") and ts["batch_size"] == 8


def test_artifact_that_breaks_parity_is_marked_failed(tmp_path):
    # Traced on an example with a positive sum, so the negative-sum samples take the wrong branch.
    samples = [torch.full((4,), 1.0 if i % 2 else -1.0) for i in range(8)]
    out = export_artifacts(ItemBranch().eval(), torch.ones(4, 4), samples, 4, tmp_path, ["onnx", "torchscript"])
    assert out["onnx"]["exporter"] == "torchscript" and "data-dependent" in out["onnx"]["fallback_reason"]
    for fmt in ("onnx", "torchscript"):
        assert out[fmt]["status"] == "failed"
        assert out[fmt]["error"].startswith("parity: an output differs") and not out[fmt]["parity"]["ok"]


def test_metric_drop_fails_parity_and_unknown_formats_raise(tmp_path):
    model, samples = SmallCNN().eval(), _images()

    def accuracy(outputs: torch.Tensor, batch: tuple) -> float:
        return float((outputs.argmax(1) == batch[1]).float().mean())

    out = export_artifacts(
        model, default_collate(samples[:8]), samples, 8, tmp_path, ["torchscript"], metric=accuracy, baseline_metric=2.0
    )
    assert out["torchscript"]["status"] == "failed" and "the metric drops" in out["torchscript"]["error"]
    with pytest.raises(ConfigError, match="Known: onnx, torchscript"):
        export_artifacts(model, default_collate(samples[:8]), samples, 8, tmp_path, ["tflite"])
