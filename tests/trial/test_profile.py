"""The profiled window: a gzipped Chrome trace whose operators are the table's, shares that add
up, the stages' ranges, training steps, and ONNX Runtime's own node times."""

import gzip
import json
import os
import sys

import pytest
import torch

from autotune.config import Config
from autotune.trial.build import build
from autotune.trial.opfamily import FAMILIES, STAGES, TRAIN_STAGES, op_family, summarize
from autotune.trial.profile import markers_dropped, profile_state, profile_training
from tests.models import MLP, TinyCNN, classification_data, image_data


def _trace_names(path) -> set[str]:
    with gzip.open(path, "rt") as f:  # a gzip file holding JSON, as Perfetto and chrome://tracing read it
        trace = json.load(f)
    return {e.get("name") for e in trace["traceEvents"]}


def _check_shares(summary: dict) -> None:
    assert set(summary["families"]) == set(FAMILIES)
    assert sum(f["share"] for f in summary["families"].values()) == pytest.approx(1.0)
    assert sum(s["share"] for s in summary["stages"].values()) == pytest.approx(1.0)
    assert summary["op_ms"] <= summary["window_ms"]  # operators run inside the stages' ranges
    ops = summary["operators"]
    assert ops == sorted(ops, key=lambda o: -o["self_ms"])
    assert sum(o["share"] for o in ops) <= 1.0 + 1e-9


def test_the_trace_holds_the_tables_operators_and_the_stages(tmp_path):
    state = build(MLP(), Config({"batch_size": 16}), "cpu")
    summary = profile_state(state, classification_data(), tmp_path / "trace-best.json.gz")
    names = _trace_names(tmp_path / "trace-best.json.gz")
    assert {o["name"] for o in summary["operators"]} <= names
    assert {"autotune::" + s for s in STAGES} <= names
    assert summary["operators"][0]["family"] in FAMILIES
    assert "aten::addmm" in {o["name"] for o in summary["operators"]}
    assert summary["stages"]["forward"]["ms"] > 0
    assert 2 <= summary["n_steps"] <= 20 and summary["n_samples"] == 16 * summary["n_steps"]
    assert summary["profile_s"] < 15 and summary["runtime"] == "torch"
    _check_shares(summary)


def test_conv_and_channels_last_are_in_their_families(tmp_path):
    state = build(TinyCNN(), Config({"batch_size": 8, "channels_last": True}), "cpu")
    summary = profile_state(state, image_data(), tmp_path / "t.json.gz")
    assert summary["families"]["conv"]["ms"] > 0
    _check_shares(summary)


def test_a_training_step_has_forward_backward_and_optimizer_ranges(tmp_path):
    from autotune.run.training import training

    data = classification_data()
    setup = training(MLP(), (torch.optim.SGD, {"lr": 0.1}), data, {"batch_size": 16}, device="cpu")

    def epochs():
        while True:
            yield from setup.loader

    summary = profile_training(
        setup, epochs(), lambda out, b: torch.nn.functional.cross_entropy(out, b[1]), tmp_path / "t.json.gz"
    )
    assert list(summary["stages"]) == list(TRAIN_STAGES)
    assert all(summary["stages"][s]["ms"] > 0 for s in ("forward", "backward", "optimizer_step"))
    assert {"autotune::backward", "autotune::optimizer_step"} <= _trace_names(tmp_path / "t.json.gz")
    _check_shares(summary)


def test_onnx_runtime_nodes_are_the_operators(tmp_path):
    pytest.importorskip("onnxruntime")
    from autotune.knobs.state import BuildExtras

    data = classification_data()
    extras = BuildExtras(example=torch.utils.data.default_collate(data[:4]))
    state = build(MLP(), Config({"batch_size": 16, "runtime": "onnxruntime"}), "cpu", extras=extras)
    summary = profile_state(state, data, tmp_path / "trace-best.json.gz")
    assert summary["runtime"] == "onnxruntime"
    ort_ops = [o for o in summary["operators"] if o["name"].startswith("onnxruntime::")]
    assert ort_ops and any(o["family"] == "matmul/linear" for o in ort_ops)
    assert summary["runtime_trace"] == "trace-best-onnxruntime.json.gz"
    with gzip.open(tmp_path / summary["runtime_trace"], "rt") as f:
        assert any(e.get("cat") == "Node" for e in json.load(f))
    _check_shares(summary)


def test_operator_families():
    assert op_family("aten::mkldnn_convolution") == "conv"
    assert op_family("aten::scaled_dot_product_attention") == "attention"
    assert op_family("quantized::linear_dynamic") == "matmul/linear"
    assert op_family("aten::quantize_per_tensor") == "quantize/dequantize"
    assert op_family("LayerNormalization") == "normalisation"
    assert op_family("Memcpy HtoD (Pageable -> Device)") == "data movement"
    assert op_family("aten::threshold_backward") == "elementwise"


def test_an_empty_window_has_zero_shares():
    s = summarize([], {"forward": 0.0}, n_steps=2, n_samples=0)
    assert s["operators"] == [] and s["families"]["other"]["share"] == 0.0


def test_the_profilers_start_and_stop_lines_are_dropped_and_nothing_else(capfd):
    with markers_dropped():
        os.write(2, b"USDT:2026-11-25 04:35:29 24624:24624 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"[E kineto] CUPTI could not be initialised\n")
        print("an error from Python", file=sys.stderr)
        os.write(2, b"USDT:2026-11-25 04:35:29 24624:24624 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert "[E kineto] CUPTI could not be initialised\n" in err and "an error from Python\n" in err


def test_a_profiled_window_writes_no_marker_lines(tmp_path, capfd):
    state = build(MLP(), Config({"batch_size": 16}), "cpu")
    profile_state(state, classification_data(), tmp_path / "trace-best.json.gz")
    assert "USDT:" not in capfd.readouterr().err


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_on_cuda_the_window_records_kernels_and_times_them_on_the_device(tmp_path):
    state = build(TinyCNN(), Config({"batch_size": 8, "amp_dtype": "float16", "pin_memory": True}), "cuda")
    summary = profile_state(state, image_data(64), tmp_path / "trace-best.json.gz")
    with gzip.open(tmp_path / "trace-best.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    categories = {e.get("cat") for e in events}
    assert "kernel" in categories, categories  # CUDA activity: the device's own kernels
    assert "gpu_memcpy" in categories, categories  # the batches' copies to the device
    assert summary["time_basis"] == "device (kernel) time"
    assert summary["families"]["conv"]["share"] > 0
    # Every stage that runs on the device took time in its CPU range: a range's device-side
    # twin (a gpu_user_annotation of the same name) must not stand in for it.
    stages = {name: summary["stages"][name]["ms"] for name in STAGES}
    assert all(ms > 0 for name, ms in stages.items() if name != "loader_wait"), stages
    _check_shares(summary)
