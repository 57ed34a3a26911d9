"""The exporters get the example batch on the tuned model's device, never the CPU copy kept in
:class:`~autotune.knobs.state.BuildExtras` (a CUDA model traced on a CPU example fails with
"Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same").

This machine has one device, so the example's device alone cannot tell the two apart: the
example is spied on instead. :meth:`BuildExtras.example_on` hands out a fresh copy and records
the device asked for, and the exporters record what they were given; an exporter fed the stored
CPU example directly gets an object ``example_on`` never returned.
"""

import json

import pytest
import torch
from torch.utils.data import default_collate

import autotune
from autotune.config import Config
from autotune.data import map_tensors
from autotune.knobs.state import BuildExtras
from autotune.trial.build import build
from tests.models import MLP, classification_data


@pytest.fixture
def handed_out(monkeypatch):
    """Every ``(device, example)`` that ``BuildExtras.example_on`` returned, each a fresh copy."""
    handed: list[tuple[str, object]] = []
    original = BuildExtras.example_on

    def example_on(self, device):
        example = map_tensors(torch.clone, original(self, device))
        handed.append((device, example))
        return example

    monkeypatch.setattr(BuildExtras, "example_on", example_on)
    return handed


def _spy(monkeypatch, module, name: str, seen: list) -> None:
    """Record the example each call of ``module.name`` gets, then run the real exporter."""
    real = getattr(module, name)

    def spy(model, example, *args, **kwargs):
        seen.append(example)
        return real(model, example, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def _asked_for(example: object, handed: list, device: str) -> bool:
    return any(got is example and where == device for where, got in handed)


@pytest.mark.parametrize(
    ("runtime", "exporter"),
    [
        ("torchscript", "autotune.export.torchscript.export_torchscript"),
        ("onnxruntime", "autotune.export.onnx.export_onnx"),
    ],
)
def test_the_runtime_knob_exports_on_the_models_device(monkeypatch, handed_out, runtime, exporter):
    import importlib

    module_name, name = exporter.rsplit(".", 1)
    seen: list = []
    _spy(monkeypatch, importlib.import_module(module_name), name, seen)
    extras = BuildExtras(example=default_collate(classification_data(8))[0])
    state = build(MLP(), Config({"runtime": runtime}), "cpu", extras=extras)
    assert state.runtime == runtime and len(seen) == 1
    assert _asked_for(seen[0], handed_out, state.device), "the exporter got the stored example, not example_on(device)"
    out = state.model(extras.example)
    assert out.shape == (8, 4)


def test_the_winners_export_gets_the_example_on_the_models_device(monkeypatch, handed_out, tmp_path):
    import autotune.runtimes.artifacts as export

    seen: list = []
    _spy(monkeypatch, export, "export_artifacts", seen)
    result = autotune.optimize(
        MLP(),
        classification_data(96),
        space={"base": None},
        out_dir=tmp_path,
        device="cpu",
        n_trials=1,
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_verify_pairs=1,
        isolation="inprocess",
    )
    assert seen and all(_asked_for(example, handed_out, "cpu") for example in seen)
    saved = json.loads((tmp_path / "best_config.json").read_text())["artifacts"]
    assert set(result.artifacts) == {"onnx", "torchscript"}
    assert {record["status"] for record in saved.values()} == {"ok"}
