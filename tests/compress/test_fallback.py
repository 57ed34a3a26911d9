"""int8_fallback in the search: the fragile layer stays float, the guard holds, and the kept
layers travel with the run (best_config.json, apply, the exported graph, verify, resume)."""

import json

import onnx
import torch

import autotune
from tests.models import FragileMLP, vector_data

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
    assert result.best_config["int8_fallback"] == "auto" and result.best["metric_drop"] <= 0.01
    tuned = autotune.apply(FragileMLP(), tmp_path / "b", dataset=vector_data(), device="cpu")
    layers = {n.split("fc.")[-1]: type(m) for n, m in tuned.named_modules() if n.split(".")[-2:-1] == ["fc"]}
    assert [n for n, t in layers.items() if t is torch.nn.Linear] == ["2"]  # fc.2 alone stays float
    assert all("quantized" in layers[n].__module__ for n in ("0", "4", "6"))


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


def test_a_resumed_study_reuses_the_ranking(tmp_path):
    args = {"space": {"base": None}, "out_dir": tmp_path, "export": (), **COMMON}
    first = autotune.optimize(
        FragileMLP(), vector_data(), fix={"quantization": "int8_dynamic", "int8_fallback": 1}, n_trials=2, **args
    )
    ranked = _trials(first)
    assert len(ranked) == 1 and "int8_ranking" in ranked[0] and ranked[0]["int8_kept"] == ["fc.2"]
    again = autotune.optimize(
        FragileMLP(),
        vector_data(),
        fix={"quantization": "int8_dynamic", "int8_fallback": 2},
        n_trials=3,
        resume=True,
        **args,
    )
    later = [t for t in _trials(again) if t["config"]["int8_fallback"] == 2]
    assert later and "int8_ranking" not in later[0]  # taken from the study, not computed again
    assert later[0]["int8_kept"][0] == "fc.2"
