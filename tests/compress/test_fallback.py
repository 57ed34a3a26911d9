"""int8_fallback in the search: the fragile layer stays float, the guard holds, and the kept
layers travel with the run (best_config.json, apply, the exported graph, verify, resume)."""

import json

import onnx
import pytest
import torch

import autotune
from tests.models import FragileCNN, FragileMLP, bare_images, vector_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}
# Size first: the int8 candidate wins on its bytes whatever the timings, so what ships is tested.
COMMON = {"device": "cpu", "isolation": "inprocess", "measure": FAST, "n_verify_pairs": 2, "objectives": ["size"]}


def _trials(result):
    return [t.user_attrs for t in result.study.trials if t.user_attrs.get("config", {}).get("int8_fallback") != 0]


def test_all_layers_int8_breaks_the_guard_and_auto_keeps_the_fragile_one_float(tmp_path):
    fix = {"quantization": "int8_dynamic", "int8_fallback": 0}
    every = autotune.optimize(
        FragileMLP(),
        vector_data(),
        space={"base": None},
        fix=fix,
        n_trials=2,
        out_dir=tmp_path / "a",
        export=(),
        **COMMON,
    )
    assert [t.user_attrs["kind"] for t in every.study.trials][1] == "guard"  # int8 everywhere: ruined
    fix = {"quantization": "int8_dynamic", "int8_fallback": "auto"}
    result = autotune.optimize(
        FragileMLP(),
        vector_data(),
        space={"base": None},
        fix=fix,
        n_trials=2,
        out_dir=tmp_path / "b",
        export=(),
        **COMMON,
    )
    int8 = json.loads((tmp_path / "b" / "best_config.json").read_text())["int8"]
    assert int8["kept_float"] == ["fc.2"] and int8["n_layers"] == 4 and int8["bytes"] < int8["float_bytes"]
    assert (int8["method"], int8["runtime"], int8["per_channel"]) == ("int8_dynamic", "torch", False)
    assert result.best_config["int8_fallback"] == "auto" and result.best["metric_drop"] <= 0.01
    tuned = autotune.apply(FragileMLP(), tmp_path / "b", dataset=vector_data(), device="cpu")
    layers = {n.split("fc.")[-1]: type(m) for n, m in tuned.named_modules() if n.split(".")[-2:-1] == ["fc"]}
    assert [n for n, t in layers.items() if t is torch.nn.Linear] == ["2"]  # fc.2 alone stays float
    assert all("quantized" in layers[n].__module__ for n in ("0", "4", "6"))


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_the_onnx_winner_ships_the_mixed_graph_it_was_measured_as(tmp_path):
    fix = {"runtime": "onnxruntime", "ort_precision": "int8_dynamic", "int8_fallback": "auto"}
    autotune.optimize(
        FragileMLP(),
        vector_data(),
        space={"base": None},
        fix=fix,
        n_trials=2,
        out_dir=tmp_path,
        export=("onnx",),
        **COMMON,
    )
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["config"]["runtime"] == "onnxruntime"
    assert 1 <= len(best["int8"]["kept_float"]) < best["int8"]["n_layers"]  # some layers int8, not all
    graph = onnx.load(str(tmp_path / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert "MatMulInteger" in ops and ("MatMul" in ops or "Gemm" in ops)  # quantized and float layers
    assert best["artifacts"]["onnx"]["int8_kept"] == best["int8"]["kept_float"]
    assert autotune.verify(tmp_path)["artifacts"]["onnx"]["status"] == "ok"
    out = autotune.load(tmp_path)(torch.stack(vector_data(4)))
    assert out.shape == (4, 8)


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_a_resumed_study_reuses_the_ranking(tmp_path):
    args = {"space": {"base": None}, "out_dir": tmp_path, "export": (), **COMMON}
    first = autotune.optimize(
        FragileMLP(),
        vector_data(),
        fix={"quantization": "int8_dynamic", "int8_fallback": 1, "int8_per_channel": False},
        n_trials=2,
        **args,
    )
    ranked = _trials(first)
    assert len(ranked) == 1 and "int8_ranking" in ranked[0] and ranked[0]["int8_kept"] == ["fc.2"]
    again = autotune.optimize(
        FragileMLP(),
        vector_data(),
        fix={"quantization": "int8_dynamic", "int8_fallback": 2, "int8_per_channel": False},
        n_trials=3,
        resume=True,
        **args,
    )
    later = [t for t in _trials(again) if t["config"]["int8_fallback"] == 2]
    assert later and "int8_ranking" not in later[0]  # taken from the study, not computed again
    assert later[0]["int8_kept"][0] == "fc.2"


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_static_int8_fallback_travels_with_the_run(tmp_path):
    """PT2E static int8 with auto: the fragile layer stays float in the trial and in apply()."""
    fix = {"quantization": "int8_static", "int8_fallback": "auto"}
    # Static ranges are calibrated on samples the guard never scores: enough of them (half the
    # data, 64) that validation's inputs stay inside them.
    result = autotune.optimize(
        FragileMLP(), vector_data(), space={"base": None}, fix=fix, n_trials=2, out_dir=tmp_path, export=(), n_val=64,
        **COMMON,
    )  # fmt: skip
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert result.best_config["quantization"] == "int8_static" and result.best["metric_drop"] <= 0.01
    assert "fc.2" in best["int8"]["kept_float"] and len(best["int8"]["kept_float"]) < best["int8"]["n_layers"] == 4
    tuned = autotune.apply(FragileMLP(), tmp_path, dataset=vector_data(), device="cpu")
    int8 = sum(t.dtype == torch.int8 for t in tuned.state_dict().values() if isinstance(t, torch.Tensor))
    assert int8 == 4 - len(best["int8"]["kept_float"])  # the same layers int8 as the run measured
    x = torch.stack(vector_data(16, seed=1))
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(tuned(x), FragileMLP()(x)).min()
    assert cosine > 0.99


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_static_int8_of_convolutions_keeps_the_fragile_convolution_float(tmp_path):
    """The CPU conv recipe's int8: PT2E with the x86 inductor quantizer quantizes the
    convolutions (per-channel weights), and auto keeps the one whose input has an outlier
    channel float, in the trial and in apply()."""
    fix = {"quantization": "int8_static", "int8_fallback": "auto"}
    result = autotune.optimize(
        FragileCNN(), bare_images(), space={"base": None}, fix=fix, n_trials=2, out_dir=tmp_path, export=(), n_val=64,
        **COMMON,
    )  # fmt: skip
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert result.best_config["quantization"] == "int8_static" and result.best["metric_drop"] <= 0.01
    kept = best["int8"]["kept_float"]
    assert "convs.2" in kept and len(kept) < best["int8"]["n_layers"] == 4, best["int8"]
    # Every kept layer's error is its relative output error alone in int8, in one unit: the
    # fragile convolution's is the largest and none is an unmeasured 0.
    errors = best["int8"]["kept_error"]
    assert set(errors) == set(kept) and all(e > 0 for e in errors.values()), best["int8"]
    assert errors["convs.2"] == max(errors.values())
    assert set(best["int8"]["kept_score"]) <= set(kept)
    tuned = autotune.apply(FragileCNN(), tmp_path, dataset=bare_images(), device="cpu")
    int8 = sum(t.dtype == torch.int8 for t in tuned.state_dict().values() if isinstance(t, torch.Tensor))
    assert int8 == 4 - len(kept) and int8 >= 2  # convolutions among them, as the run measured
    x = torch.stack(bare_images(16, seed=1))
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(tuned(x), FragileCNN()(x)).min()
    assert cosine > 0.99


@pytest.mark.slow  # the PT2E conv test above covers the conv fallback in the fast suite
def test_onnx_static_int8_of_convolutions_keeps_the_fragile_convolution_float(tmp_path):
    """ONNX Runtime's static int8 (QDQ) on the convolutions, the fragile one kept float in the
    graph that ships."""
    fix = {"runtime": "onnxruntime", "ort_precision": "int8_static", "int8_fallback": "auto"}
    autotune.optimize(
        FragileCNN(), bare_images(), space={"base": None}, fix=fix, n_trials=2, out_dir=tmp_path, export=("onnx",),
        n_val=64, **COMMON,
    )  # fmt: skip
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["config"]["ort_precision"] == "int8_static" and best["best"]["metric_drop"] <= 0.01, best["int8"]
    assert 1 <= len(best["int8"]["kept_float"]) < best["int8"]["n_layers"], best["int8"]
    graph = onnx.load(str(tmp_path / "model.onnx")).graph
    # QDQ: a quantized convolution reads a DequantizeLinear'd input and weight; a kept one, float
    # ones. The kept layers are the graph's nodes: find each convolution by its weight's name.
    producers = {o: n.op_type for n in graph.node for o in n.output}
    convs = {next(i for i in n.input if ".weight" in i): n for n in graph.node if n.op_type == "Conv"}
    int8 = {w for w, n in convs.items() if all(producers.get(i) == "DequantizeLinear" for i in n.input[:2])}
    assert not any("convs.2." in w for w in int8), int8  # the fragile convolution runs in float
    assert int8 and len(convs) == 3, convs
    assert autotune.verify(tmp_path)["artifacts"]["onnx"]["status"] == "ok"


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_per_channel_onnx_int8_ships_per_channel_scales(tmp_path):
    fix = {"runtime": "onnxruntime", "ort_precision": "int8_dynamic", "int8_per_channel": True, "int8_fallback": 0}
    autotune.optimize(
        FragileMLP(), vector_data(), space={"base": None}, fix=fix, n_trials=2, out_dir=tmp_path, export=("onnx",),
        **{**COMMON, "max_metric_drop": 1.0},
    )  # fmt: skip
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["config"]["int8_per_channel"] is True and best["config"]["runtime"] == "onnxruntime"
    assert best["int8"]["method"] == "int8_dynamic" and best["int8"]["per_channel"] is True
    assert "int8_dynamic on onnxruntime, weights scaled per output channel" in (tmp_path / "report.md").read_text()
    graph = onnx.load(str(tmp_path / "model.onnx")).graph
    inits = {t.name: t for t in graph.initializer}
    # MatMulInteger's weight zero point (input 3) and the weight scale its output is multiplied
    # by hold one value per output column when the weights are quantized per channel.
    zero_points = [inits[n.input[3]] for n in graph.node if n.op_type == "MatMulInteger" and n.input[3] in inits]
    weight_scales = [inits[i] for n in graph.node if n.op_type == "Mul" for i in n.input if i in inits and "scale" in i]
    assert zero_points and all(len(t.dims) == 1 and t.dims[0] > 1 for t in zero_points)
    assert any(len(t.dims) == 1 and t.dims[0] > 1 for t in weight_scales)
    assert autotune.verify(tmp_path)["artifacts"]["onnx"]["status"] == "ok"


def test_a_torch_fallback_winner_ships_onnx_with_layers_kept_float(tmp_path):
    """No exporter takes torch's int8 modules: the ONNX artifact is the float model quantized by
    ONNX Runtime, with the fewest layers float that keep the guard, ranked on the graph."""
    fix = {"quantization": "int8_dynamic", "int8_fallback": "auto"}
    autotune.optimize(
        FragileMLP(), vector_data(), space={"base": None}, fix=fix, n_trials=2, out_dir=tmp_path, export=("onnx",),
        **COMMON,
    )  # fmt: skip
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["config"]["quantization"] == "int8_dynamic" and best["int8"]["kept_float"] == ["fc.2"]
    onnx_record = best["artifacts"]["onnx"]
    assert onnx_record["status"] == "ok", onnx_record.get("error")
    assert 1 <= len(onnx_record["quantized"]["kept_float"]) < 4
    ops = [n.op_type for n in onnx.load(str(tmp_path / "model.onnx")).graph.node]
    assert "MatMulInteger" in ops and ("MatMul" in ops or "Gemm" in ops)
    assert autotune.verify(tmp_path)["artifacts"]["onnx"]["status"] == "ok"


@pytest.mark.parametrize(("objectives", "for_speed"), [(["throughput"], True), (["size"], False)])
def test_a_run_for_speed_alone_asks_whether_int8_pays(objectives, for_speed):
    # The worker's int8 plan reads the spec a run prepared: only a run for speed alone times
    # int8 against float before keeping layers float (a run that weighs size keeps searching).
    import types

    from autotune.trial.inference import TrialContext
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.spec import WorkerSpec

    sizes = "size" in objectives or len(objectives) > 1  # as autotune.run.prepare sets it
    spec = WorkerSpec(model=None, dataset=[], metric=None, device="cpu", baseline={}, val_indices=[],
                      measure=MeasureSettings(), sizes=sizes)  # fmt: skip
    plan = TrialContext._int8_plan(types.SimpleNamespace(spec=spec), ["logits"], 60.0)
    assert plan.for_speed is for_speed and plan.budget_s == 60.0
