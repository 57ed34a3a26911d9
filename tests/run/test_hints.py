"""The note a CPU run of the default preset adds: PyTorch int8, ONNX Runtime and TorchScript are in cpu-deploy."""

import pytest

import autotune
from autotune.run.hints import space_note
from autotune.run.options import Options
from tests.models import MLP, classification_data


@pytest.mark.parametrize(
    ("options", "noted"),
    [
        ({}, True),
        ({"space": {"batch_size": [8, 16]}}, True),  # on top of the default preset
        ({"fix": {"num_workers": 0}}, True),
        ({"space": "cpu-deploy"}, False),
        ({"space": "quick"}, False),
        ({"space": {"base": None, "batch_size": [8, 16]}}, False),
        ({"space": {"runtime": "all"}}, False),
        ({"fix": {"quantization": "int8_dynamic"}}, False),
        ({"devices": "cpu,cpu"}, True),
    ],
)
def test_a_cpu_run_of_the_default_preset_is_told_where_int8_and_runtimes_are(options, noted):
    note = space_note(Options(device="cpu", **options))
    assert (note is not None) == noted
    if noted:
        assert "cpu-deploy" in note and "int8" in note and "\n" not in note


def test_training_runs_and_cuda_runs_get_no_note():
    import torch

    train = Options(device="cpu", mode="train", loss_fn=lambda o, b: o.sum(), optimizer=torch.optim.SGD, export=())
    assert space_note(train) is None
    assert space_note(Options(device="cpu", devices=[0])) is None


def test_optimize_returns_the_note_with_its_result(tmp_path):
    result = autotune.optimize(
        MLP(),
        classification_data(64),
        space={"batch_size": [8, 16]},
        fix={"num_workers": 0, "compile_mode": "none", "amp_dtype": "float32"},
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.02, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=2,
        n_finalists=0,
        device="cpu",
        isolation="inprocess",
        out_dir=tmp_path,
        export=(),
        profile=False,
        progress=False,
    )
    assert result.notes[-1] == space_note(Options(device="cpu"))
