"""An OpenVINO winner end to end: measured and guarded in the search, its IR shipped with parity,
served by ``autotune.load`` in a process that imports no torch, re-checked by ``verify``.

The model is a deep, narrow MLP (48 Linear + ReLU pairs on 16 features): eager PyTorch pays its
per-operator overhead 96 times a batch, which OpenVINO's compiled graph does not, so OpenVINO
wins on any CPU.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import autotune
from autotune.config import Config
from tests.models import classification_data

pytest.importorskip("openvino", reason="runtime=openvino needs the openvino extra")

FAST = {"n_windows": 2, "window_s": 0.1, "warmup_batches": 2, "n_remeasure": 0}


class DeepMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [m for _ in range(48) for m in (nn.Linear(16, 16), nn.ReLU())]
        self.net = nn.Sequential(*layers, nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("openvino-run")
    result = autotune.optimize(
        DeepMLP(),
        classification_data(256),
        space={"base": None, "runtime": ["torch", "openvino"]},
        fix={"runtime": "openvino"},
        device="cpu",
        out_dir=out,
        n_trials=2,
        n_val=64,
        measure=FAST,
        n_verify_pairs=1,
        export=("torchscript",),
        isolation="inprocess",
    )
    return out, result


def _best(out):
    return json.loads((out / "best_config.json").read_text())


def test_the_openvino_candidate_is_measured_and_guarded(run):
    _out, result = run
    trials = [t.user_attrs for t in result.study.trials if t.user_attrs.get("config", {}).get("runtime") == "openvino"]
    assert trials, "no OpenVINO trial ran"
    for attrs in trials:
        assert attrs["status"] == "ok", attrs.get("reason")
        assert attrs["samples_per_s"] > 0 and attrs["metric_drop"] <= 0.01
        assert attrs["openvino_converted_from"] == "torch"


def test_the_winner_ships_its_ir_with_parity(run):
    out, result = run
    assert result.best_config["runtime"] == "openvino"
    record = _best(out)["artifacts"]["openvino"]
    assert record["status"] == "ok" and record["winner"] is True
    assert record["path"] == "model.xml" and record["bin_path"] == "model.bin"
    assert (out / "model.xml").is_file() and (out / "model.bin").is_file()
    assert record["parity"]["ok"] and record["parity"]["baseline_fidelity"] >= 0.99
    assert record["openvino"]["precision"] == "f32"
    # The other format is labelled: exported from the torch model, not the winner.
    assert _best(out)["artifacts"]["torchscript"]["winner"] is False


_NO_TORCH = """
import json, sys
import numpy as np
{block}
import autotune
pred = autotune.load(sys.argv[1]{fmt})
x = np.load(sys.argv[2])
np.save(sys.argv[3], pred(x))
print(json.dumps({{"torch": sys.modules.get("torch") is not None, "format": pred.format, "chosen": pred.chosen}}))
"""


def _serve_in_a_fresh_process(out, tmp_path, *, block_torch: bool, fmt: str = ""):
    x = np.random.default_rng(0).standard_normal((70, 16)).astype(np.float32)  # 70: chunks of 32, padded
    np.save(tmp_path / "x.npy", x)
    code = _NO_TORCH.format(block="sys.modules['torch'] = None" if block_torch else "", fmt=fmt)
    argv = [sys.executable, "-c", code, str(out), str(tmp_path / "x.npy"), str(tmp_path / "y.npy")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": ".", "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        expected = DeepMLP().eval()(torch.from_numpy(x)).numpy()
    return json.loads(done.stdout.strip().splitlines()[-1]), np.load(tmp_path / "y.npy"), expected


def test_load_serves_the_ir_in_a_process_that_imports_no_torch(run, tmp_path):
    facts, got, expected = _serve_in_a_fresh_process(run[0], tmp_path, block_torch=False, fmt=", format='openvino'")
    assert facts["torch"] is False and facts["format"] == "openvino"
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_without_torch_installed_load_serves_the_openvino_winner(run, tmp_path):
    facts, got, expected = _serve_in_a_fresh_process(run[0], tmp_path, block_torch=True)
    assert facts["format"] == "openvino" and "torch is not installed" in facts["chosen"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_load_with_torch_compares_the_ir_with_the_other_files(run):
    served = autotune.load(run[0])
    assert "openvino" in served.chosen and "torchscript" in served.chosen  # both timed here, on the same batches
    out = served(torch.randn(5, 16))
    assert isinstance(out, torch.Tensor) and out.shape == (5, 4)


def test_verify_rechecks_the_ir_and_its_weights_file(run, tmp_path):
    import shutil

    report = autotune.verify(run[0], n_batches=2)
    assert report["artifacts"]["openvino"]["status"] == "ok", report["artifacts"]["openvino"]["reason"]
    copy = tmp_path / "copy"
    shutil.copytree(run[0], copy)
    weights = bytearray((copy / "model.bin").read_bytes())
    weights[-4:] = b"\x00\x00\x80\x7f"  # the last float32 weight made infinite
    (copy / "model.bin").write_bytes(bytes(weights))
    assert autotune.verify(copy, n_batches=1)["artifacts"]["openvino"]["status"] == "modified"
    with pytest.raises(autotune.ConfigError, match=r"model\.bin"):
        autotune.load(copy, format="openvino")


@pytest.mark.slow
def test_a_damaged_int8_candidate_is_rejected_by_the_guard(tmp_path, monkeypatch):
    """NNCF int8 of every layer of a model whose head reads an outlier channel: the guard rejects
    it; with int8_fallback=auto the head stays float and it passes."""
    import autotune.compress.sensitivity_ov as sensitivity_ov
    from tests.export.test_openvino import OutlierMLP

    # Whether int8 pays is the CPU's (this MLP's int8 IR ran 0.76x its float one on an AVX2-only
    # CPU, and auto then stops): both passes run, the ratio is fixed, so the outcome is not the CPU's.
    monkeypatch.setattr(
        sensitivity_ov, "speed_ratio", lambda float_pass, int8_pass: [float_pass(), int8_pass(), 2.0][-1]
    )

    result = autotune.optimize(
        OutlierMLP(),
        classification_data(512),
        space={"base": None, "runtime": ["torch", "openvino"], "int8_fallback": [0, "auto"]},
        fix={"runtime": "openvino", "ov_precision": "int8_static"},
        device="cpu",
        out_dir=tmp_path,
        n_trials=3,
        n_val=128,
        measure=FAST,
        n_verify_pairs=1,
        export=(),
        isolation="inprocess",
    )
    by_fallback = {
        t.user_attrs["config"]["int8_fallback"]: t.user_attrs
        for t in result.study.trials
        if t.user_attrs.get("config", {}).get("runtime") == "openvino"
    }
    assert set(by_fallback) == {0, "auto"}, textwrap.shorten(str(by_fallback), 500)
    assert by_fallback[0]["metric_drop"] > 0.01  # measured, then refused by the guard
    assert by_fallback[0]["status"] != "ok" or not by_fallback[0].get("feasible", True)
    kept = by_fallback["auto"]
    assert kept["status"] == "ok" and kept["metric_drop"] <= 0.01, kept.get("reason")
    assert len(kept["int8_kept"]) == 1 and "head" in kept["int8_kept"][0]
    # The float weights' size beside the int8 IR's (whose XML outweighs them on a model this small).
    assert kept["float_bytes"] > 0 and kept["size_bytes"] > 0


def test_an_openvino_int8_winner_is_told_as_nncf_int8_on_openvino():
    """The result's int8 entry of an OpenVINO int8 winner names OpenVINO and its precision, not
    torch's quantization knob (which such a winner leaves at none); apply rebuilds it on the
    run's calibration draw."""
    from autotune.run.output import _int8_record, _rebuild_record

    config = {"runtime": "openvino", "ov_precision": "int8_static", "quantization": "none", "int8_fallback": "auto"}
    best = {"config": config, "int8_kept": ["head"], "float_bytes": 4000, "size_bytes": 1300}
    int8 = _int8_record(best)
    assert (int8["runtime"], int8["method"], int8["kept_float"]) == ("openvino", "int8_static", ["head"])
    assert (int8["float_bytes"], int8["bytes"]) == (4000, 1300)
    draw = {"n_val": 128, "seed": 3, "calibration_batch_size": 32, "n_calibration": 8}
    assert _rebuild_record({"rebuild": draw}, best)["seed"] == 3
    assert _int8_record({"config": {**config, "ov_precision": "fp32"}}) is None


def test_a_cnns_int8_layers_are_ranked_with_the_input_nncf_left_float():
    """NNCF leaves a CNN's first convolution reading the model's input in float: its layer alone,
    built for the ranking, referred to the whole model's input ("Model references undeclared
    parameters"), and every CNN's int8_fallback trial failed (the digits CNN, a ResNet)."""
    from autotune.compress.sensitivity_ov import rank_openvino
    from autotune.export.openvino import convert_openvino, quantize_openvino
    from tests.models import TinyCNN

    model, example = TinyCNN().eval(), torch.randn(4, 3, 8, 8)
    float_model, info = convert_openvino(model, example)
    gen = torch.Generator().manual_seed(0)
    feeds = [{info["input_names"][0]: torch.randn(8, 3, 8, 8, generator=gen).numpy()} for _ in range(2)]
    ranking = rank_openvino(float_model, quantize_openvino(float_model, feeds), feeds)
    conv = [n for n in ranking.layers if "Convolution" in n]
    assert conv and ranking.cheap_error[conv[0]] > 0.0, ranking


def test_two_conversions_of_a_model_name_its_layers_alike():
    """OpenVINO names ops it makes from a process-wide counter: a ResNet's folded convolutions
    were Multiply_4706 in the search's conversion and Multiply_26202 in the confirmation's, whose
    rebuild then refused the run's ranking ("the ranking is for another model") and no speedup
    was claimed."""
    from autotune.compress.sensitivity_ov import openvino_layers
    from autotune.export.openvino import convert_openvino, quantize_openvino

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)
    ).eval()
    example = torch.randn(4, 3, 12, 12)
    first, info = convert_openvino(model, example)
    second, _ = convert_openvino(model, example)
    feeds = [{info["input_names"][0]: example.numpy()}]
    names = [openvino_layers(quantize_openvino(m, feeds)) for m in (first, second)]
    assert names[0] and names[0] == names[1]
    assert [op.get_friendly_name() for op in first.get_ordered_ops()] == [
        op.get_friendly_name() for op in second.get_ordered_ops()
    ]


def test_a_second_int8_build_of_the_same_model_reads_the_runs_cache(tmp_path, monkeypatch):
    """A confirmation's two fresh workers and the export each quantized the pick again (NNCF and
    its fallback, 10-15 s a build of real MiniLM); the run's workers now share what NNCF made."""
    import types

    from autotune.export.openvino import CACHE_ENV, convert_openvino
    from autotune.runtimes.openvino import _int8

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model, example = DeepMLP().eval(), torch.randn(8, 16)
    float_model, info = convert_openvino(model, example)
    gen = torch.Generator().manual_seed(0)
    feeds = [{info["input_names"][0]: torch.randn(16, 16, generator=gen).numpy()} for _ in range(2)]
    extras = types.SimpleNamespace(int8=None, calibration=[])
    config = Config(runtime="openvino", ov_precision="int8_static", int8_fallback=0)
    first_info, second_info, other_info = {}, {}, {}
    first = _int8(float_model, config, extras, feeds, False, first_info)
    second = _int8(convert_openvino(model, example)[0], config, extras, feeds, False, second_info)
    assert not first_info.get("int8_cached") and second_info["int8_cached"]
    assert first_info["int8_transformer"] == second_info["int8_transformer"] is False
    # The seconds its making took, which a rebuild from the cache skips (the finish prices them out).
    assert first_info["int8_made_s"] > 0
    # Outside a run's workers there is no cache: a rebuild makes it again, and nothing is priced out.
    monkeypatch.delenv(CACHE_ENV)
    alone = {}
    _int8(float_model, config, extras, feeds, False, alone)
    assert "int8_made_s" not in alone and not alone.get("int8_cached")
    import openvino as ov

    x = torch.randn(4, 16).numpy()
    outs = [ov.Core().compile_model(m, "CPU").create_infer_request().infer([x]).to_tuple()[0] for m in (first, second)]
    np.testing.assert_array_equal(outs[0], outs[1])
    # Other calibration batches are another model.
    _int8(float_model, config, extras, feeds[:1], False, other_info)
    assert not other_info.get("int8_cached")


def test_the_int8_cache_is_shared_by_configurations_that_differ_in_the_loader_and_threads(tmp_path, monkeypatch):
    """A search's OpenVINO int8 trials at other batch sizes and thread counts quantized the same
    model again (7 NNCF runs of real MiniLM in 16 trials): the IR does not depend on them."""
    import types

    from autotune.export.openvino import CACHE_ENV, convert_openvino
    from autotune.runtimes.openvino import _int8

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    float_model, info = convert_openvino(DeepMLP().eval(), torch.randn(8, 16))
    feeds = [{info["input_names"][0]: torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).numpy()}]
    extras = types.SimpleNamespace(int8=None, calibration=[])
    config = Config(runtime="openvino", ov_precision="int8_static", int8_fallback=0, batch_size=32)
    _int8(float_model, config, extras, feeds, False, {})
    neighbour = {}
    _int8(float_model, config.but(batch_size=64, num_threads=1), extras, feeds, False, neighbour)
    assert neighbour["int8_cached"]


def test_a_damaged_int8_cache_entry_is_made_again_not_a_failed_trial(tmp_path, monkeypatch):
    import types

    from autotune.export.openvino import CACHE_ENV, convert_openvino
    from autotune.runtimes.openvino import _int8

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    float_model, info = convert_openvino(DeepMLP().eval(), torch.randn(8, 16))
    feeds = [{info["input_names"][0]: torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).numpy()}]
    extras = types.SimpleNamespace(int8=None, calibration=[])
    config = Config(runtime="openvino", ov_precision="int8_static", int8_fallback=0)
    _int8(float_model, config, extras, feeds, False, {})
    (entry,) = (tmp_path / "cache").iterdir()
    (entry / "model.xml").write_text("<net")  # cut short
    again = {}
    assert _int8(float_model, config, extras, feeds, False, again) is not None
    assert not again.get("int8_cached") and (entry / "info.json").is_file()  # quantized and written anew
    read = {}
    _int8(float_model, config, extras, feeds, False, read)
    assert read["int8_cached"]


def _ov_outputs(model, x):
    import openvino as ov

    return ov.Core().compile_model(model, "CPU").create_infer_request().infer([x.numpy()]).to_tuple()[0]


def test_a_second_openvino_build_of_the_same_torch_model_reads_its_conversion_from_the_runs_cache(
    tmp_path, monkeypatch
):
    """Every OpenVINO trial, confirmation worker and export converted its torch model again (a
    trace and convert_model: 1.7 s of a 2.2-s build of real MiniLM); a run's workers now read a
    conversion of the same model, and only of the same model, from the run's cache."""
    import types

    from autotune.export.openvino import CACHE_ENV, float_cache
    from autotune.runtimes.openvino import _converted

    example, x = torch.randn(8, 16), torch.randn(4, 16)

    def convert(model):
        state = types.SimpleNamespace(model=model.eval(), info={})
        converted, info = _converted(state, example, False, tmp_path)
        return converted, info, state.info

    assert float_cache(DeepMLP(), example, False) is None  # outside a run's workers: converted every time
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first, first_info, first_made = convert(DeepMLP())
    second, second_info, second_made = convert(DeepMLP())
    assert first_made["ov_convert_s"] > 0 and not first_made.get("ov_converted_cached")
    assert second_made == {"ov_converted_cached": True}  # the conversion's seconds are not paid again
    assert second_info == first_info and second_info["converted_from"] == "torch"
    np.testing.assert_array_equal(_ov_outputs(first, x), _ov_outputs(second, x))
    # Other weights (a pruned or fine-tuned model) are another model.
    changed = DeepMLP()
    with torch.no_grad():
        changed.net[-1].bias.add_(1.0)
    third, _, third_made = convert(changed)
    assert not third_made.get("ov_converted_cached")
    np.testing.assert_allclose(_ov_outputs(third, x), _ov_outputs(first, x) + 1.0, rtol=1e-5, atol=1e-6)

    # A setting forward reads that repr does not show (autocast's dtype, a user's flag) is another model.
    flagged = DeepMLP()
    flagged.scale = 3
    _, _, flagged_made = convert(flagged)
    assert not flagged_made.get("ov_converted_cached")

    # Another forward under the same class name is another model too.
    def doubled(self, x):
        return 2 * self.net(x)

    other = type("DeepMLP", (DeepMLP,), {"forward": doubled, "__qualname__": DeepMLP.__qualname__})
    fourth, _, fourth_made = convert(other())
    assert not fourth_made.get("ov_converted_cached")
    np.testing.assert_allclose(_ov_outputs(fourth, x), 2 * _ov_outputs(first, x), rtol=1e-5, atol=1e-6)


class _ShowsAnAddress(DeepMLP):
    def __init__(self) -> None:
        super().__init__()
        self.helper = object()
        self.register_buffer("scale", torch.ones(4), persistent=False)

    def extra_repr(self) -> str:
        return f"helper={self.helper}"  # "<object object at 0x...>": another in every copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


class _ReprRaises(DeepMLP):
    def extra_repr(self) -> str:
        raise TypeError("Object of type dtype is not JSON serializable")


def test_the_conversion_key_holds_across_copies_and_buffers_and_a_model_it_cannot_key_is_converted(
    tmp_path, monkeypatch
):
    """A repr that shows an address gave another key in every copy (a miss, and another full IR
    on disk, in every trial); a buffer left out of the state dict (rotary frequencies, say)
    changes the model; a repr that raises must not fail the build."""
    import copy

    from autotune.export.openvino import CACHE_ENV, float_cache

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    example = torch.randn(8, 16)
    model = _ShowsAnAddress().eval()
    key = float_cache(model, example, False).folder
    assert float_cache(copy.deepcopy(model), example, False).folder == key
    model.scale.mul_(2.0)  # not persistent: not in the state dict, still the model
    assert float_cache(model, example, False).folder != key
    assert float_cache(_ReprRaises().eval(), example, False) is None
