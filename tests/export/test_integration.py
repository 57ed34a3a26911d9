"""The search's winner is exported, checked and served."""

import json

import numpy as np
import pytest
import torch

import autotune
from tests.models import MLP, Oracle, classification_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}


def test_winner_is_exported_with_parity_and_served(tmp_path, cpu_env):
    fix = {"amp_dtype": "bfloat16"} if cpu_env.bf16 else {}
    result = autotune.optimize(
        Oracle(),
        classification_data(),
        space={"base": None, "batch_size": [8, 32]},
        fix=fix,
        out_dir=tmp_path,
        device="cpu",
        n_trials=2,
        measure=FAST,
        n_verify_pairs=1,
    )
    saved = json.loads((tmp_path / "best_config.json").read_text())["artifacts"]
    assert set(result.artifacts) == {"onnx", "torchscript"}
    for art in saved.values():
        assert art["status"] == "ok" and art["parity"]["ok"] and len(art["sha256"]) == 64 and art["bytes"] > 0
    if result.best_config["amp_dtype"] == "bfloat16":  # exported in float32 on the CPU, and says so
        assert "float32" in saved["onnx"]["form_note"]
    x = np.stack([s[0].numpy() for s in classification_data(40)])
    expected = autotune.apply(Oracle(), result.best_config, device="cpu")(torch.from_numpy(x)).detach().numpy()
    for fmt in ("onnx", "torchscript"):
        got = autotune.load(tmp_path, format=fmt)(x)
        assert isinstance(got, np.ndarray) and got.shape == (40, 4)
        assert (got.argmax(1) == expected.argmax(1)).mean() >= 0.95


def test_export_none_writes_no_artifacts(tmp_path):
    result = autotune.optimize(
        Oracle(),
        classification_data(),
        space={"base": None},
        out_dir=tmp_path,
        device="cpu",
        n_trials=1,
        measure=FAST,
        export=(),
        isolation="inprocess",
    )
    assert result.artifacts == {} and not (tmp_path / "model.onnx").exists()
    with pytest.raises(autotune.ConfigError, match="No export format named 'tflite'"):
        autotune.optimize(Oracle(), classification_data(), out_dir=tmp_path / "x", export=("tflite",))


def test_bfloat16_winner_on_cpu_exports_a_float32_onnx_that_passes_parity(tmp_path):
    from autotune.knobs.state import TunedModule
    from autotune.runtimes.artifacts import export_artifacts
    from autotune.runtimes.base import get_runtime
    from autotune.trial.inference import _export_form

    tuned = TunedModule(Oracle().eval(), "bfloat16", False)
    model, note = _export_form(get_runtime("onnxruntime"), tuned, "cpu")
    assert model.amp_dtype is None and "float32" in note and "ONNX Runtime's CPU provider" in note
    # A runtime that runs the autocast graph (a TorchScript trace) is exported from the winner itself.
    assert _export_form(get_runtime("torchscript"), tuned, "cpu") == (tuned, None)
    samples = classification_data(64)
    example = torch.utils.data.default_collate(samples[:8])
    art = export_artifacts(model, example, samples, 16, tmp_path, ["onnx"])["onnx"]
    assert art["status"] == "ok", art


@pytest.mark.slow  # CI time: test_a_torch_fallback_winner_ships_onnx_with_layers_kept_float takes the same path
def test_int8_winner_onnx_is_the_pruned_float_model_quantized_by_onnxruntime(tmp_path):
    from tests.compress.test_quantize import MLP

    data = [(torch.randn(256), torch.tensor(i % 10)) for i in range(256)]
    result = autotune.optimize(
        MLP(),
        data,
        space={"base": None},
        fix={"quantization": "int8_dynamic"},
        objectives=("size",),
        out_dir=tmp_path,
        device="cpu",
        n_trials=2,
        measure=FAST,
        n_verify_pairs=1,
        max_metric_drop=0.05,
    )
    assert result.best_config["quantization"] == "int8_dynamic"
    onnx = json.loads((tmp_path / "best_config.json").read_text())["artifacts"]["onnx"]
    assert "quantized by onnxruntime" in onnx["form_note"] and onnx["quantized"]
    # ONNX Runtime's int8 is not torch's int8: the outputs differ by a few percent, which the
    # parity check measures and judges with the export's tolerances, never hides.
    parity = onnx["parity"]
    assert parity["rel_l2"] < 0.2 and parity["fidelity"] >= 0.9
    assert (onnx["status"] == "ok") == parity["ok"]
    # It is not the model that was measured: labelled so, never shown under the winner's speedup.
    assert onnx["winner"] is False
    fp32_bytes = result.baseline["size_bytes"]
    assert onnx["bytes"] <= 0.35 * fp32_bytes  # the int8 weights really are in the file


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_an_onnxruntime_int8_winner_ships_its_measured_quantized_graph(tmp_path):
    import onnx as onnx_lib

    result = autotune.optimize(
        MLP(),
        classification_data(128),
        space={"base": None},
        fix={"runtime": "onnxruntime", "ort_precision": "int8_dynamic"},
        out_dir=tmp_path,
        device="cpu",
        n_trials=2,
        # The int8 candidate must win whatever the timings: this is about what ships, so the
        # objective is size, where int8 wins by construction.
        objectives=["size"],
        measure={**FAST, "max_others_cpu": 1.0},
        n_verify_pairs=3,
        max_metric_drop=1.0,
        isolation="inprocess",
        baseline_batch_size=16,
    )
    assert result.best_config["runtime"] == "onnxruntime"
    artifacts = json.loads((tmp_path / "best_config.json").read_text())["artifacts"]
    onnx = artifacts["onnx"]
    ops = {node.op_type for node in onnx_lib.load(str(tmp_path / "model.onnx")).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeLinear" in ops, ops
    assert onnx["winner"] is True and onnx["precision"] == "int8_dynamic"
    assert onnx["ort"]["graph_optimization"] == result.best_config["ort_graph_optimization"]
    assert onnx["parity"]["rel_l2"] == 0.0  # the very graph that was measured
    assert artifacts["torchscript"]["winner"] is False and "torch model" in artifacts["torchscript"]["form_note"]
    report = autotune.verify(tmp_path)
    assert report["artifacts"]["onnx"]["status"] == "ok" and report["artifacts"]["onnx"]["samples_per_s"] > 0


def test_an_artifact_of_a_compiled_winner_is_labelled_as_another_model():
    """torch.compile has no file format: the exported module is the uncompiled one, so it must
    not be presented as the measured winner (or under its speedup)."""
    import torch

    from autotune.knobs.state import BuildState
    from autotune.trial.inference import _label

    compiled = BuildState(model=torch.nn.Linear(2, 2), device="cpu", compile_mode="max-autotune-no-cudagraphs")
    record: dict = {"status": "ok"}
    _label(record, "torchscript", compiled, None)
    assert record["winner"] is False and "torch.compile" in record["form_note"]
    eager = BuildState(model=torch.nn.Linear(2, 2), device="cpu")
    record = {"status": "ok"}
    _label(record, "torchscript", eager, None)
    assert record["winner"] is True and "form_note" not in record


def test_a_compiled_winner_is_exported_from_its_uncompiled_module_without_compiling(tmp_path):
    """No file carries torch.compile, so the export builds the winner uncompiled: a compiled
    MiniLM pick's export spent 40 s compiling for parity outputs no artifact was made from."""
    from torch._dynamo.utils import counters

    from autotune.config import Config
    from autotune.trial.inference import TrialContext
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.spec import WorkerSpec

    spec = WorkerSpec(model=MLP(), dataset=classification_data(), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
                      measure=MeasureSettings())  # fmt: skip
    ctx = TrialContext(spec)
    config = dict(Config({"batch_size": 8, "compile_mode": "default", "compile_dynamic": True}))
    before = counters["stats"]["unique_graphs"]
    artifacts = ctx.export(config, str(tmp_path), ["torchscript", "onnx"])["artifacts"]
    assert counters["stats"]["unique_graphs"] == before, "the export compiled the winner"
    for fmt in ("torchscript", "onnx"):
        record = artifacts[fmt]
        assert record["status"] == "ok" and record["parity"]["ok"], record
        assert record["winner"] is False and "torch.compile (mode default)" in record["form_note"]
    assert (tmp_path / "parity.pt").exists()


class ExportsACond(torch.nn.Module):
    """A classifier that, as export-aware library code does, takes another path under
    torch.export: a ``torch.cond`` (both branches the same here). Eager, it traces; its int8_static
    form, a PT2E graph holding that ``cond``, is one TorchScript cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.fc(x))
        if torch.compiler.is_exporting():
            hidden = torch.cond(hidden.sum() > 0, lambda h: h * 2, lambda h: h * 2, (hidden,))
        else:
            hidden = hidden * 2
        return self.head(hidden)


def test_a_float_torchscript_written_for_an_untraceable_int8_winner_is_not_labelled_the_winner(tmp_path):
    result = autotune.optimize(
        ExportsACond(),
        classification_data(128),
        space={"base": None},
        fix={"quantization": "int8_static", "int8_fallback": 0},  # every layer int8, the one trial
        objectives=("size",),  # int8 wins by construction: this is about what ships
        out_dir=tmp_path,
        device="cpu",
        n_trials=2,
        measure={**FAST, "max_others_cpu": 1.0},
        n_verify_pairs=1,
        max_metric_drop=1.0,
        export=("torchscript",),
        isolation="inprocess",
    )
    assert result.best_config["quantization"] == "int8_static"
    path = tmp_path / "best_config.json"
    saved = json.loads(path.read_text())
    script = saved["artifacts"]["torchscript"]
    assert script["form"] == "fallback" and "cond" in script["reason"]
    assert script["winner"] is False and "pruned float model" in script["form_note"]
    # load() never presents it as the measured winner, even from a record that says it is one.
    assert "NOT the measured winner" in autotune.load(tmp_path, format="torchscript").chosen
    saved["artifacts"]["torchscript"].update(winner=True, status="ok")
    del saved["artifacts"]["torchscript"]["form_note"]
    path.write_text(json.dumps(saved))
    assert "NOT the measured winner" in autotune.load(tmp_path).chosen


def test_a_text_winners_export_runs_its_model_over_the_samples_once_and_stores_those_outputs(tmp_path):
    """The TorchScript and ONNX checks and parity.pt each ran the tuned model over the validation
    samples (a second each of real MiniLM): once now, and what verify re-checks against is what
    the guard would collect, batched as the winner batches."""
    import functools

    import autotune.export.parity as parity
    from autotune.batching import pad_collate
    from autotune.config import Config
    from autotune.trial import artifacts
    from autotune.trial.guard import collect_outputs
    from autotune.trial.inference import TrialContext
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.spec import WorkerSpec
    from tests.models import TextEncoder, text_data

    spec = WorkerSpec(model=TextEncoder(), dataset=text_data(48), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)), measure=MeasureSettings(),
                      collate_fn=functools.partial(pad_collate, pad_values={}), sequence=True)  # fmt: skip
    ctx = TrialContext(spec)
    config = dict(Config({"batch_size": 8, "padding": "trim", "length_grouping": 4}))
    runs, collected = [], []
    real_runs, real_collect = parity._run_per_sample, artifacts.collect_outputs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parity, "_run_per_sample", lambda fn, *a, **k: runs.append(fn) or real_runs(fn, *a, **k))
        mp.setattr(artifacts, "collect_outputs", lambda *a, **k: collected.append(a) or real_collect(*a, **k))
        records = ctx.export(config, str(tmp_path), ["torchscript", "onnx"])["artifacts"]
    assert {r["status"] for r in records.values()} == {"ok"}
    models = [fn for fn in runs if isinstance(fn, torch.nn.Module) and not hasattr(fn, "runner")]
    assert len({id(m) for m in models}) == 1 and len(models) == 1 and not collected, (runs, collected)
    stored = torch.load(tmp_path / "parity.pt", weights_only=True)["outputs"]
    state = ctx.build(config)
    torch.testing.assert_close(torch.as_tensor(stored), collect_outputs(state, ctx.samples), atol=1e-5, rtol=1e-4)
