"""Sensitivity-ranked int8 fallback: the ranking finds the fragile layer, ``auto`` keeps the
fewest float, mixed graphs hold exactly the named layers float; real onnxruntime and torch.

The fragile layer is made as real models have one: a channel of its input sits far above the
others (a bias of 300 after a ReLU), with the matching weight row scaled down so the model's
output stays sane. A per-tensor int8 activation scale then spends its 256 levels on that one
channel and the rest round to zero.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import autotune.compress as sens
from autotune.compress.int8_gain import GAIN_BATCHES
from autotune.errors import ConfigError, InputError, TrialError

WIDTH = 32


def _mlp_weights(outliers: dict[int, float]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Four layers 16-32-32-32-8; layer ``i`` in ``outliers`` reads an outlier channel 0."""
    rng = np.random.default_rng(0)
    shapes = [(16, WIDTH), (WIDTH, WIDTH), (WIDTH, WIDTH), (WIDTH, 8)]
    weights = [(rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32) for s in shapes]
    biases = [np.zeros(s[1], np.float32) for s in shapes]
    for layer, value in outliers.items():
        biases[layer - 1][0] = value
        weights[layer][0] /= value
    return weights, biases


def _onnx_mlp(path: Path, outliers: dict[int, float]) -> Path:
    """MatMul+Add+Relu layers ``fc0``-``fc2`` and a last Gemm ``fc3`` (transB) with its bias."""
    weights, biases = _mlp_weights(outliers)
    nodes, inits, x = [], [], "x"
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        if i == 3:
            inits += [numpy_helper.from_array(w.T.copy(), f"W{i}"), numpy_helper.from_array(b, f"b{i}")]
            nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"b{i}"], ["y"], name=f"fc{i}", transB=1))
            break
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [
            helper.make_node("MatMul", [x, f"W{i}"], [f"m{i}"], name=f"fc{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),  # unnamed on purpose
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        x = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


def _torch_mlp(outliers: dict[int, float]) -> nn.Sequential:
    weights, biases = _mlp_weights(outliers)
    layers: list[nn.Module] = []
    for w, b in zip(weights, biases, strict=True):
        linear = nn.Linear(*w.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T))
            linear.bias.copy_(torch.from_numpy(b))
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers[:-1]).eval()  # names 0, 2, 4, 6


def _batches(n: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.normal(size=(8, 16)).astype(np.float32) for _ in range(n)]


@pytest.fixture(scope="module")
def one_outlier(tmp_path_factory) -> Path:
    return _onnx_mlp(tmp_path_factory.mktemp("sens") / "mlp.onnx", {1: 300.0})


@pytest.fixture(scope="module")
def two_outliers(tmp_path_factory) -> Path:
    return _onnx_mlp(tmp_path_factory.mktemp("sens") / "mlp2.onnx", {1: 300.0, 2: 30.0})


def _float_layers(path: Path | str) -> set[str]:
    """Layers of a quantized graph that still multiply by a float weight read straight from an
    initializer (dynamic int8 rewrites Gemm ``g`` as MatMul ``g_MatMul``)."""
    model = onnx.load(str(path))
    floats = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    return {
        n.name.removesuffix("_MatMul")
        for n in model.graph.node
        if n.op_type in ("MatMul", "Gemm") and n.input[1] in floats
    }


def _op_types(path: Path | str) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


# --- ranking ----------------------------------------------------------------------------------


def test_onnx_layers_lists_matmul_and_gemm_in_graph_order(one_outlier):
    assert sens.onnx_layers(one_outlier) == ["fc0", "fc1", "fc2", "fc3"]
    assert sens.onnx_layers(one_outlier, "int8_static") == ["fc0", "fc1", "fc2", "fc3"]


@pytest.mark.parametrize("method", sens.METHODS)
def test_onnx_ranking_puts_the_outlier_layer_first(one_outlier, method):
    cheap = sens.rank_onnx(one_outlier, method, _batches(), sens.worst_cosine, refine=False)
    assert cheap.layers[0] == "fc1"
    assert cheap.exact_score == {}
    assert cheap.cheap_error["fc1"] > 10 * max(e for n, e in cheap.cheap_error.items() if n != "fc1")

    refined = sens.rank_onnx(one_outlier, method, _batches(), sens.worst_cosine)
    assert refined.layers[0] == "fc1"
    assert refined.exact_score["fc1"] == min(refined.exact_score.values())
    assert refined.n_batches == 3 and refined.method == method and refined.backend == "onnxruntime"


def _quantized_error(float_path: Path, int8_path: Path, batches: list[np.ndarray]) -> float:
    ref, cand = ort.InferenceSession(str(float_path)), ort.InferenceSession(str(int8_path))
    num = den = 0.0
    for x in batches:
        y, y_q = ref.run(None, {"x": x})[0].astype(np.float64), cand.run(None, {"x": x})[0]
        num, den = num + float(np.sum((y_q - y) ** 2)), den + float(np.sum(y**2))
    return float(np.sqrt(num / den))


def _one_layer(path: Path, op: str) -> tuple[Path, list[np.ndarray]]:
    """A graph of one MatMul (16 -> 8) or one Conv (3 -> 8 channels, 3x3, padded), and batches."""
    rng = np.random.default_rng(2)
    if op == "MatMul":
        node, shape = helper.make_node("MatMul", ["x", "W"], ["y"], name="only"), [16]
        inits = [numpy_helper.from_array(rng.normal(size=(16, 8)).astype(np.float32), "W")]
    else:
        node, shape = helper.make_node("Conv", ["x", "W", "B"], ["y"], name="only", pads=[1, 1, 1, 1]), [3, 8, 8]
        inits = [
            numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.normal(size=8).astype(np.float32) / 10, "B"),
        ]
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *shape])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path, [rng.normal(size=(4, *shape)).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("op", ["MatMul", "Conv"])
@pytest.mark.parametrize("method", sens.METHODS)
def test_cheap_error_is_what_onnxruntime_int8_does(tmp_path, method, op):
    """On a one-layer graph the layer's output is the graph's: the emulated error must be the
    error ONNX Runtime's quantized graph makes on this CPU (int16 pair saturation included where
    its uint8 x int8 kernels saturate: x86 without VNNI). Static int8 also rounds the bias to
    int32, which the emulation leaves float: hence 1e-3."""
    src, batches = _one_layer(tmp_path / "one.onnx", op)
    ranking = sens.rank_onnx(src, method, batches, sens.worst_cosine, refine=False)
    sens.quantize_onnx_except(src, tmp_path / "int8.onnx", method, [], batches)
    actual = _quantized_error(src, tmp_path / "int8.onnx", batches)
    assert ranking.cheap_error["only"] == pytest.approx(actual, rel=1e-3)


def test_torch_ranking_puts_the_outlier_layer_first():
    model = _torch_mlp({1: 300.0})
    batches = [torch.from_numpy(x) for x in _batches()]
    cheap = sens.rank_torch(model, batches, sens.worst_cosine, refine=False)
    assert sens.torch_layers(model) == ["0", "2", "4", "6"]
    assert cheap.layers[0] == "2"
    refined = sens.rank_torch(model, batches, sens.worst_cosine)
    assert refined.layers[0] == "2" and refined.exact_score["2"] == min(refined.exact_score.values())
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # untouched


def test_torch_cheap_error_is_the_int8_kernels():
    model = _torch_mlp({})[:1].eval()  # one Linear: its output is the model's
    batches = [torch.from_numpy(x) for x in _batches()]
    ranking = sens.rank_torch(model, batches, sens.worst_cosine, refine=False)
    quantized = sens.quantize_torch_except(model, [])
    with torch.no_grad():
        ys = [(model(x).double(), quantized(x).double()) for x in batches]
    actual = (sum(float(((q - y) ** 2).sum()) for y, q in ys) / sum(float((y**2).sum()) for y, _ in ys)) ** 0.5
    assert ranking.cheap_error["0"] == pytest.approx(actual, rel=1e-6)


def test_budget_stops_refinement(one_outlier):
    ranking = sens.rank_onnx(one_outlier, "int8_dynamic", _batches(), sens.worst_cosine, budget_s=0)
    assert ranking.exact_score == {} and ranking.layers[0] == "fc1"


@pytest.mark.parametrize("method", ["int8_dynamic", "int8_static"])
def test_the_onnx_cheap_pass_and_auto_keep_to_the_budget(two_outliers, tmp_path, method):
    # The cheap pass streams batch by batch and stops after the one that ends the budget; so
    # does auto's bisection, at the fewest measured to pass.
    ranking = sens.rank_onnx(two_outliers, method, _batches(), sens.worst_cosine, budget_s=0)
    assert ranking.n_batches == 1 and ranking.layers[0] == "fc1"
    full = sens.rank_onnx(two_outliers, method, _batches(), sens.worst_cosine, refine=False)
    args = (two_outliers, tmp_path / "q.onnx", method, full, _batches(), sens.worst_cosine, 0.999)
    found = sens.fallback_onnx(*args, budget_s=0)
    assert len(found["tries"]) == 1 and "time budget" in found["reason"]


def test_ranking_round_trips_through_json(one_outlier):
    ranking = sens.rank_onnx(one_outlier, "int8_dynamic", _batches(), sens.worst_cosine, refine=2)
    assert len(ranking.exact_score) >= 2
    again = sens.Ranking.from_json(ranking.to_json())
    assert again == ranking and again.layers == ranking.layers
    with pytest.raises(ConfigError, match="fields"):
        sens.Ranking.from_json(ranking.to_json().replace('"cost_s"', '"seconds"'))
    with pytest.raises(ConfigError, match="int8 method"):
        sens.Ranking("int8_weight_only", "onnxruntime", ["a"], {"a": 0.1})


# --- fallback ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", sens.METHODS)
def test_auto_keeps_the_fewest_layers_that_pass(two_outliers, tmp_path, method):
    batches, threshold = _batches(), 0.999
    ranking = sens.rank_onnx(two_outliers, method, batches, sens.worst_cosine)
    found = sens.fallback_onnx(
        two_outliers, tmp_path / "auto.onnx", method, ranking, batches, sens.worst_cosine, threshold
    )
    assert found["feasible"] and 1 <= found["k"] < found["n_layers"] == 4
    assert found["kept"] == ranking.top(found["k"])
    # Measured again on their own: k passes, k - 1 does not.
    at_k = sens.fallback_onnx(
        two_outliers, tmp_path / "k.onnx", method, ranking, batches, sens.worst_cosine, threshold, k=found["k"]
    )
    below = sens.fallback_onnx(
        two_outliers, tmp_path / "k1.onnx", method, ranking, batches, sens.worst_cosine, threshold, k=found["k"] - 1
    )
    assert at_k["score"] >= threshold > below["score"]
    assert not below["feasible"] and "<" in below["reason"]
    assert _float_layers(found["path"]) == set(found["kept"])


def test_auto_torch_keeps_the_fewest_layers_that_pass():
    model = _torch_mlp({1: 300.0, 2: 30.0})
    batches, threshold = [torch.from_numpy(x) for x in _batches()], 0.999
    ranking = sens.rank_torch(model, batches, sens.worst_cosine)
    quantized, found = sens.fallback_torch(model, ranking, batches, sens.worst_cosine, threshold)
    assert found["feasible"] and found["k"] == 2 and found["kept"] == ranking.top(2)
    at_k = sens.fallback_torch(model, ranking, batches, sens.worst_cosine, threshold, k=found["k"])[1]
    below = sens.fallback_torch(model, ranking, batches, sens.worst_cosine, threshold, k=found["k"] - 1)[1]
    assert at_k["score"] >= threshold > below["score"]
    floats = {n for n, m in quantized.named_modules() if type(m) is nn.Linear}
    assert floats == set(found["kept"])


def _weight_fragile_mlp() -> nn.Sequential:
    """Layer "2" has one huge weight in every output channel (on an input channel made tiny to
    match), so int8 weights, even per channel, round all its other weights to zero."""
    model = _torch_mlp({})
    with torch.no_grad():
        model[2].weight[:, 0] = 200.0 * model[2].weight[:, 0].sign()
        model[0].weight[0] /= 200.0
        model[0].bias[0] /= 200.0
    return model


def _int8_layers(model: nn.Module, method: str) -> int:
    if method == "int8_static":  # a GraphModule: one int8 constant per quantized weight
        return sum(t.dtype == torch.int8 for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    return sum(type(m.weight) is not nn.Parameter for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize(
    ("method", "model"),
    [("int8_static", _torch_mlp({1: 300.0, 2: 30.0})), ("int8_weight_only", _weight_fragile_mlp())],
    ids=["static", "weight_only"],
)
def test_torch_static_and_weight_only_rank_the_fragile_layer_first_and_auto_is_minimal(method, model):
    batches, threshold = [torch.from_numpy(x) for x in _batches()], 0.999
    assert sens.torch_layers(model, method) == ["0", "2", "4", "6"]
    ranking = sens.rank_torch(model, batches, sens.worst_cosine, method=method)
    assert ranking.method == method and ranking.layers[0] == "2"
    quantized, found = sens.fallback_torch(model, ranking, batches, sens.worst_cosine, threshold)
    assert found["feasible"] and found["kept"] == ranking.top(found["k"]) and "2" in found["kept"]
    below = sens.fallback_torch(model, ranking, batches, sens.worst_cosine, threshold, k=found["k"] - 1)[1]
    assert below["score"] < threshold <= found["score"]
    assert _int8_layers(quantized, method) == 4 - found["k"]
    with torch.no_grad():
        assert sens.worst_cosine([model(x) for x in batches], [quantized(x) for x in batches]) >= threshold


def test_per_channel_dynamic_int8_is_ranked_as_it_runs(tmp_path):
    """A weight with one large entry per row: per-tensor int8 crushes the rest, per channel
    does not. The ranking measures each as it runs, the ONNX graph and torch alike."""
    model = _torch_mlp({})[:1].eval()
    with torch.no_grad():
        model[0].weight[0] *= 50.0  # output channel 0 spans 50x the range of the others
    batches = [torch.from_numpy(x) for x in _batches()]
    cheap = {}
    for per_channel in (False, True):
        ranking = sens.rank_torch(model, batches, sens.worst_cosine, refine=False, per_channel=per_channel)
        cheap[per_channel] = ranking.cheap_error["0"]
        quantized = sens.quantize_torch_except(model, [], per_channel=per_channel)
        with torch.no_grad():
            ys = [(model(x).double(), quantized(x).double()) for x in batches]
        actual = (sum(float(((q - y) ** 2).sum()) for y, q in ys) / sum(float((y**2).sum()) for y, _ in ys)) ** 0.5
        assert ranking.cheap_error["0"] == pytest.approx(actual, rel=1e-6)
    assert cheap[True] < cheap[False] / 2  # the small channels keep their own scale
    src, onnx_batches = _one_layer(tmp_path / "one.onnx", "MatMul")
    errors = {}
    for per_channel in (False, True):
        ranking = sens.rank_onnx(
            src, "int8_dynamic", onnx_batches, sens.worst_cosine, refine=False, per_channel=per_channel
        )
        dst = tmp_path / f"pc{per_channel}.onnx"
        sens.quantize_onnx_except(src, dst, "int8_dynamic", [], onnx_batches, per_channel=per_channel)
        errors[per_channel] = _quantized_error(src, dst, onnx_batches)
        assert ranking.cheap_error["only"] == pytest.approx(errors[per_channel], rel=1e-3)
    assert errors[True] != errors[False]


@pytest.mark.parametrize("method", sens.METHODS)
def test_mixed_graph_holds_int8_and_exactly_the_kept_float_layers(one_outlier, tmp_path, method):
    keep = ["fc1", "fc3"]  # fc3 is the Gemm, which dynamic int8 renames
    out = sens.quantize_onnx_except(one_outlier, tmp_path / "mixed.onnx", method, keep, _batches())
    ops = _op_types(out["path"])
    if method == "int8_dynamic":
        assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops
    else:
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert _float_layers(out["path"]) == set(keep) == set(out["kept"])
    assert out["quantized"] == ["fc0", "fc2"]
    # The mixed graph runs and keeps the model's outputs close.
    session = ort.InferenceSession(out["path"])
    reference = ort.InferenceSession(str(one_outlier))
    feeds = [{"x": x} for x in _batches()]
    mixed = [session.run(None, f)[0] for f in feeds]
    assert sens.worst_cosine([reference.run(None, f)[0] for f in feeds], mixed) > 0.99


def test_only_the_float_model_passing_is_reported_infeasible(one_outlier, tmp_path):
    """Threshold 1.0: the float model scores exactly 1, every int8 layer costs something."""
    ranking = sens.rank_onnx(one_outlier, "int8_dynamic", _batches(), sens.worst_cosine, refine=False)
    dst = tmp_path / "none.onnx"
    found = sens.fallback_onnx(one_outlier, dst, "int8_dynamic", ranking, _batches(), sens.worst_cosine, 1.0)
    assert found["k"] == found["n_layers"] == 4
    assert not found["feasible"] and "no int8" in found["reason"] and found["path"] is None
    assert not dst.exists()
    assert [t["k"] for t in found["tries"]][-1] == 3 and not found["tries"][-1]["passed"]


# --- faults -----------------------------------------------------------------------------------


def test_no_quantizable_layer_is_a_clear_error(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
    )
    src = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(src))
    assert sens.onnx_layers(src) == []
    for method in sens.METHODS:
        with pytest.raises(TrialError, match=r"found no layer to quantize in relu\.onnx") as info:
            sens.rank_onnx(src, method, _batches(), sens.worst_cosine)
        assert info.value.kind == "unsupported"
    with pytest.raises(TrialError, match=r"no nn\.Linear"):
        sens.rank_torch(nn.Sequential(nn.ReLU()).eval(), [torch.randn(2, 4)], sens.worst_cosine)


def test_user_errors_say_what_is_wrong(one_outlier, tmp_path):
    with pytest.raises(InputError, match=r"No quantizable layer named 'fc9'\. Known: fc0, fc1, fc2, fc3"):
        sens.quantize_onnx_except(one_outlier, tmp_path / "x.onnx", "int8_dynamic", ["fc9"], _batches())
    with pytest.raises(InputError, match="nothing is left to quantize"):
        sens.quantize_onnx_except(
            one_outlier, tmp_path / "x.onnx", "int8_dynamic", ["fc0", "fc1", "fc2", "fc3"], _batches()
        )
    with pytest.raises(ConfigError, match="Known: int8_dynamic, int8_static"):
        sens.rank_onnx(one_outlier, "int4", _batches(), sens.worst_cosine)
    with pytest.raises(InputError, match="calibration batch 0"):  # a calibration that cannot run
        sens.rank_onnx(one_outlier, "int8_static", [np.zeros((8, 5), np.float32)], sens.worst_cosine)
    with pytest.raises(InputError, match="non-empty list"):
        sens.rank_onnx(one_outlier, "int8_dynamic", [], sens.worst_cosine)
    torch_ranking = sens.Ranking("int8_dynamic", "torch", ["0"], {"0": 0.1})
    with pytest.raises(InputError, match="rank again"):
        sens.fallback_onnx(
            one_outlier, tmp_path / "x.onnx", "int8_dynamic", torch_ranking, _batches(), sens.worst_cosine, 0.9
        )
    with pytest.raises(InputError, match="training mode"):
        sens.rank_torch(_torch_mlp({}).train(), [torch.randn(2, 16)], sens.worst_cosine)


def test_criteria():
    ref = [np.eye(3), (np.ones((2, 2)), np.ones((2, 1)))]
    assert sens.worst_cosine(ref, ref) == 1.0 and sens.max_rel_error(ref, ref) == 0.0
    cand = [np.eye(3) * 2, (np.ones((2, 2)), np.full((2, 1), np.nan))]
    assert sens.worst_cosine(cand[:1], ref[:1]) == pytest.approx(1.0)
    assert sens.worst_cosine(ref, cand) == -1.0  # NaN is the worst there is
    assert sens.max_rel_error(ref[:1], cand[:1]) == pytest.approx(-1.0)
    with pytest.raises(InputError, match="batch by batch"):
        sens.worst_cosine(ref, ref[:1])


def test_torch_transformer_layers_quantize_and_run():
    """Attention's out_proj is read as a float weight by attention itself: it is not a layer;
    the fused fast path is turned off for the quantized model, which reads int8 Linears."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    batches = [torch.randn(2, 5, 16) for _ in range(2)]
    assert sens.torch_layers(model) == ["linear1", "linear2"]
    ranking = sens.rank_torch(model, batches, sens.worst_cosine, refine=1)
    quantized, found = sens.fallback_torch(model, ranking, batches, sens.worst_cosine, 0.9, k=1)
    assert found["feasible"] and quantized(batches[0]).shape == (2, 5, 16)


@pytest.mark.parametrize("runtime", ["onnxruntime", "torch"])
def test_auto_with_check_gain_stops_where_the_whole_int8_model_is_no_faster(
    two_outliers, tmp_path, monkeypatch, runtime
):
    # How much faster int8 runs is the CPU's: the ratio is fixed here, after both passes ran
    # (each a real pass of the float and the whole-int8 model), so the outcome is the machine's not.
    import autotune.compress.sensitivity_onnx as sensitivity_onnx
    import autotune.compress.sensitivity_torch as sensitivity_torch

    passes = []

    def slower(float_pass, int8_pass):
        passes.append((float_pass(), int8_pass()))
        return 0.9

    monkeypatch.setattr(sensitivity_onnx if runtime == "onnxruntime" else sensitivity_torch, "speed_ratio", slower)
    threshold = 0.999
    if runtime == "onnxruntime":
        ranking = sens.rank_onnx(two_outliers, "int8_dynamic", _batches(), sens.worst_cosine)
        found = sens.fallback_onnx(two_outliers, tmp_path / "auto.onnx", "int8_dynamic", ranking, _batches(),
                                   sens.worst_cosine, threshold, check_gain=True)  # fmt: skip
        assert found["path"] is None
    else:
        model, batches = _torch_mlp({1: 300.0, 2: 30.0}), [torch.from_numpy(x) for x in _batches()]
        ranking = sens.rank_torch(model, batches, sens.worst_cosine)
        quantized, found = sens.fallback_torch(model, ranking, batches, sens.worst_cosine, threshold, check_gain=True)
        assert quantized is None
    assert len(passes) == 1 and passes[0][0] is not None and passes[0][1] is not None
    # Timed on the first few calibration batches, not all of them (25 s of a 30-s trial on real text).
    assert len(passes[0][0]) == len(passes[0][1]) == GAIN_BATCHES < len(_batches())
    assert not found["feasible"] and found["int8_gain"] == 0.9
    assert [t["k"] for t in found["tries"]] == [0]  # every layer in int8 missed the guard; nothing bisected
    assert "int8 does not pay here" in found["reason"] and "0.90x" in found["reason"]


def test_where_int8_does_not_pay_the_layers_are_never_ranked(two_outliers, tmp_path, monkeypatch):
    """The gain check stopped the search at k = 0, and the outcome then ranked every layer only
    to list them all as float: 9 s of a 33-s OpenVINO int8 trial on real text."""
    import autotune.compress.sensitivity_onnx as sensitivity_onnx

    monkeypatch.setattr(sensitivity_onnx, "speed_ratio", lambda float_pass, int8_pass: 0.9)
    computed = []

    def compute():
        computed.append(True)
        return sens.rank_onnx(two_outliers, "int8_dynamic", _batches(), sens.worst_cosine)

    from autotune.compress.sensitivity import Deferred

    lazy = Deferred("onnxruntime", "int8_dynamic", compute)
    found = sens.fallback_onnx(two_outliers, tmp_path / "auto.onnx", "int8_dynamic", lazy, _batches(),
                               sens.worst_cosine, 0.999, check_gain=True)  # fmt: skip
    assert found["path"] is None and "int8 does not pay here" in found["reason"]
    assert computed == [] and not lazy.computed
    assert len(found["kept"]) == found["n_layers"] > 0  # every layer stays float, named in the model's order
