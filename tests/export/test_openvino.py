"""OpenVINO artifacts: conversion with dynamic axes, the IR's two files, the throughput hint's
split batches, and NNCF int8 whose damaged layer the fallback keeps float.

The damaged model is an MLP whose hidden layer has one outlier channel (x500): per-tensor int8
of the next layer's input leaves its other channels a few codes each, which ruins the outputs;
keeping that one layer float restores them.
"""

import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from autotune.compress.fallback import Int8Plan, openvino_with_fallback
from autotune.compress.int8_gain import GAIN_BATCHES
from autotune.compress.sensitivity import worst_cosine
from autotune.data import model_inputs
from autotune.errors import TrialError
from tests.models import MLP, TinyCNN, classification_data, image_data

pytest.importorskip("openvino", reason="the OpenVINO exporter needs the openvino extra")

from autotune.export.openvino import (
    OvModule,
    calibration_feeds,
    convert_openvino,
    quantize_openvino,
    save_openvino,
)
from autotune.export.ov_run import OvRunner, openvino_problem

OUTLIER = 500.0


class OutlierMLP(nn.Module):
    """16 -> 64 -> 4; hidden channel 0 is 500x the others, and the head reads it 500x weaker,
    so the float model is an ordinary classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(16, 64)
        self.head = nn.Linear(64, 4)
        scale = torch.ones(64)
        scale[0] = OUTLIER
        with torch.no_grad():
            self.hidden.weight.mul_(scale[:, None])
            self.hidden.bias.mul_(scale)
            self.head.weight.div_(scale[None, :])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(x)))


def _outputs(run, batches):
    return [run(*model_inputs(b)[0]).detach().numpy() for b in batches]


def test_openvino_runs_here():
    assert openvino_problem() is None


def test_an_absent_openvino_is_named_with_its_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    assert "openvino is not installed" in openvino_problem()


def test_the_ir_has_both_files_and_runs_any_batch(tmp_path):
    model = TinyCNN().eval()
    samples = image_data(16)
    converted, info = convert_openvino(model, default_collate(samples[:4]))
    assert info["input_names"] == ["input_0"] and info["output_names"] == ["output"]
    saved = save_openvino(converted, tmp_path / "model.xml")
    assert (tmp_path / "model.bin").stat().st_size > 8 * 3 * 3 * 3 * 4  # float32 weights kept float32
    assert saved["bytes"] == (tmp_path / "model.xml").stat().st_size + (tmp_path / "model.bin").stat().st_size
    run = OvModule(tmp_path / "model.xml", info["input_names"], info["output_names"])
    for n in (1, 5, 16):
        x = default_collate(samples[:n])[0]
        with torch.no_grad():
            torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # an ONNX export: about 10 s
def test_a_model_openvino_cannot_trace_is_converted_through_onnx(tmp_path, monkeypatch):
    import autotune.export.openvino as ovx

    def refuse(*_):
        raise RuntimeError("this trace is refused (test)")

    monkeypatch.setattr(ovx, "_trace", refuse)
    samples = classification_data(8)
    converted, info = convert_openvino(MLP().eval(), default_collate(samples)[0], onnx_path=tmp_path / "m.onnx")
    assert info["converted_from"] == "onnx" and "refused" in info["fallback_reason"]
    x = default_collate(samples)[0]
    got = OvModule(converted, info["input_names"], info["output_names"])(x)
    torch.testing.assert_close(got, MLP()(x).detach(), rtol=1e-4, atol=1e-5)


def test_the_throughput_hint_splits_a_batch_over_its_requests_and_joins_it(tmp_path):
    samples = classification_data(64)
    converted, _info = convert_openvino(MLP().eval(), default_collate(samples[:8])[0])
    save_openvino(converted, tmp_path / "model.xml")
    x = default_collate(samples)[0].numpy()
    latency = OvRunner(tmp_path / "model.xml", ["input_0"], ["output"], threads=2)
    throughput = OvRunner(tmp_path / "model.xml", ["input_0"], ["output"], hint="throughput", threads=2)
    assert throughput.properties()["n_requests"] >= 1
    np.testing.assert_allclose(throughput.run([x])[0], latency.run([x])[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(throughput.run([x[:3]])[0], latency.run([x[:3]])[0], rtol=1e-5, atol=1e-6)


def _outlier_case():
    samples = classification_data(256)
    model = OutlierMLP().eval()
    converted, info = convert_openvino(model, default_collate(samples[:8])[0])
    batches = [default_collate(samples[i : i + 32]) for i in range(0, 128, 32)]
    feeds = calibration_feeds(batches, info["input_names"])
    held = [default_collate(samples[i : i + 32]) for i in range(128, 256, 32)]
    return model, converted, info, batches, feeds, held


def _scored(model, converted, info, held):
    with torch.no_grad():
        reference = _outputs(model, held)
    return worst_cosine(reference, _outputs(OvModule(converted, info["input_names"], info["output_names"]), held))


def test_int8_of_every_layer_ruins_the_outlier_model_and_the_fallback_keeps_its_layer_float():
    model, converted, info, batches, feeds, held = _outlier_case()
    whole = quantize_openvino(converted, feeds)
    assert _scored(model, whole, info, held) < 0.99  # the damage the fallback is for
    plan = Int8Plan(kinds=["logits"], max_drop=0.01, budget_s=60)
    kept, record = openvino_with_fallback(converted, "auto", batches, feeds, plan, {}, transformer=False)
    # The head reads the outlier channel: it is the layer kept float, and the only one.
    assert record["int8_k"] == 1 and record["int8_layers"] == 2
    assert len(record["int8_kept"]) == 1 and "head" in record["int8_kept"][0]
    assert _scored(model, kept, info, held) > 0.99
    ranking = record["int8_ranking"]
    assert '"backend": "openvino"' in ranking


def test_a_run_s_kept_layers_are_kept_again_without_a_ranking():
    model, converted, info, batches, feeds, held = _outlier_case()
    first = openvino_with_fallback(
        converted, "auto", batches, feeds, Int8Plan(kinds=["logits"], max_drop=0.01), {}, False
    )[1]
    plan = Int8Plan(keep=list(first["int8_kept"]))
    kept, record = openvino_with_fallback(converted, "auto", batches, feeds, plan, {}, transformer=False)
    assert record == {"int8_kept": first["int8_kept"]}
    assert _scored(model, kept, info, held) > 0.99


def test_keeping_every_layer_float_is_no_int8_at_all():
    _model, converted, _info, batches, feeds, _ = _outlier_case()
    with pytest.raises(TrialError, match="leaves none"):
        openvino_with_fallback(converted, 2, batches, feeds, Int8Plan(kinds=["logits"], max_drop=0.01), {}, False)


@pytest.mark.parametrize("gain", [0.9, 1.5])
def test_auto_for_speed_stops_where_the_whole_int8_model_is_no_faster(monkeypatch, gain):
    # How much faster int8 runs is the CPU's (twice the float IR with VNNI, 0.95 of it for
    # all-MiniLM-L6-v2 on an AVX2-only AMD EPYC): the ratio is fixed here, after both passes ran,
    # so the outcome does not depend on the machine that runs the test.
    import autotune.compress.sensitivity_ov as sensitivity_ov
    from autotune.compress.sensitivity import MIN_INT8_GAIN

    asked = []

    def ratio(float_pass, int8_pass):
        asked.append((float_pass(), int8_pass()))
        return gain

    monkeypatch.setattr(sensitivity_ov, "speed_ratio", ratio)
    _model, converted, _info, batches, feeds, _ = _outlier_case()
    plan = Int8Plan(kinds=["logits"], max_drop=0.01, for_speed=True)
    if gain < MIN_INT8_GAIN:  # no layer kept float can make a faster build: no ranking, no bisection
        with pytest.raises(TrialError, match=r"int8 does not pay here: the whole-int8 model ran 0\.90x"):
            openvino_with_fallback(converted, "auto", batches, feeds, plan, {}, transformer=False)
    else:
        record = openvino_with_fallback(converted, "auto", batches, feeds, plan, {}, transformer=False)[1]
        assert record["int8_k"] == 1 and "head" in record["int8_kept"][0]
    assert len(asked) == 1  # asked once, where every layer in int8 missed the guard
    assert len(asked[0][0]) == len(asked[0][1]) == GAIN_BATCHES < len(feeds)  # timed on a few batches
    # A run that weighs size never asks: int8 is smaller however fast it runs.
    asked.clear()
    plan = Int8Plan(kinds=["logits"], max_drop=0.01)
    assert openvino_with_fallback(converted, "auto", batches, feeds, plan, {}, transformer=False)[1]["int8_k"] == 1
    assert asked == []


def test_a_verdict_that_int8_does_not_pay_is_read_by_the_next_trial_on_this_cpu(tmp_path, monkeypatch):
    """A warm run paid NNCF and the timing again (30 s of a 146-s search of real MiniLM on an
    AVX2-only CPU) to learn that int8 ran 0.72x the float IR, as the first run had; the next trial
    of the same model and guard on the same CPU now reads the verdict. A run that weighs size
    never reads it (int8 is smaller however fast it runs), and a ratio near 1 is timed again."""
    import types

    import autotune.compress.sensitivity_ov as sensitivity_ov
    from autotune.config import Config
    from autotune.export.openvino import CACHE_ENV
    from autotune.runtimes.openvino import _int8

    timed = []
    gain = {"value": 0.8}

    def ratio(float_pass, int8_pass):
        timed.append(True)
        return gain["value"]

    monkeypatch.setattr(sensitivity_ov, "speed_ratio", ratio)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    _model, converted, _info, batches, feeds, _ = _outlier_case()
    config = Config(runtime="openvino", ov_precision="int8_static", int8_fallback="auto")

    def trial(for_speed=True):
        plan = Int8Plan(kinds=["logits"], max_drop=0.01, for_speed=for_speed)
        extras, info = types.SimpleNamespace(int8=plan, calibration=batches), {}
        try:
            return _int8(converted, config, extras, feeds, False, info), info
        except TrialError as exc:
            return str(exc), info

    first, _ = trial()
    second, info = trial()
    assert "int8 does not pay here" in first and len(timed) == 1  # the second trial timed nothing
    assert second.startswith(first) and "earlier trial" in second and info["int8_gain_cached"]
    # A damaged verdict (a record without its reason) is timed again and written anew, never a crash.
    (entry,) = (tmp_path / "cache").glob("*-slower-*")
    (entry / "info.json").write_text("{}")
    assert "does not pay" in trial()[0] and len(timed) == 2 and "reason" in (entry / "info.json").read_text()
    # Where another CPU ran it (another verdict's key), or the ratio was near 1, it is timed again.
    for entry in (tmp_path / "cache").glob("*-slower-*"):
        entry.rename(entry.with_name(entry.name.rsplit("-", 1)[0] + "-othercpu"))
    gain["value"] = 1.02
    assert "does not pay" in trial()[0] and "does not pay" in trial()[0] and len(timed) == 4
    # Weighing size, int8 is searched for: the head kept float.
    gain["value"] = 0.8
    trial()
    built, info = trial(for_speed=False)
    assert not isinstance(built, str) and info["int8_k"] == 1 and len(timed) == 5
