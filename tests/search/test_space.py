import json

import pytest
import torch

import autotune
from autotune.data import describe
from autotune.errors import ConfigError
from autotune.knobs import SpaceContext
from autotune.search.space import load_preset, resolve_space


@pytest.fixture()
def ctx(cpu_env):
    return SpaceContext(cpu_env, describe([(torch.zeros(3, 8, 8), 0)] * 300), 32)


def test_values_the_env_cannot_run_are_removed_with_reasons(ctx):
    space = resolve_space("default", ctx)
    assert "float16" not in space.values["amp_dtype"]
    assert space.excluded["amp_dtype"]["float16"]
    assert 512 not in space.values["batch_size"] and "larger than the dataset" in space.excluded["batch_size"]["512"]


def test_the_baseline_is_always_a_candidate(ctx):
    space = resolve_space({"base": None, "batch_size": [64, 128]}, ctx)
    assert space.values["batch_size"] == [32, 64, 128] and space.contains(space.baseline)
    assert all(len(v) == 1 for k, v in space.values.items() if k != "batch_size")


def test_fix_pins_a_knob(ctx):
    space = resolve_space("quick", ctx, fix={"batch_size": 16})
    assert space.values["batch_size"] == [16]
    with pytest.raises(ConfigError, match="Cannot fix pin_memory=true: pinned memory"):
        resolve_space("quick", ctx, fix={"pin_memory": True})


def test_a_fixed_knob_of_one_runtime_holds_the_search_to_the_runtimes_it_applies_under(ctx):
    """``--fix compile_mode=default`` with two trials ran the one trial after the baseline on
    OpenVINO, where compile_mode stands aside: the run the user asked to compile compiled nothing."""
    offered = resolve_space("default", ctx).values["runtime"]
    assert len(offered) > 1, offered  # OpenVINO is in the dev extra: the hold has a runtime to leave out
    space = resolve_space("default", ctx, fix={"compile_mode": "default"})
    assert space.values["runtime"] == ["torch"]
    for other in offered[1:]:
        assert "compile_mode" in space.excluded["runtime"][other], other
    listed = {
        "base": None,
        "runtime": ["torch", "onnxruntime", "openvino"],
        "ov_precision": ["fp32", "bf16", "int8_static"],
    }
    ov = resolve_space(listed, ctx, fix={"ov_hint": "throughput"})
    assert ov.values["runtime"][0] == "torch" and "onnxruntime" not in ov.values["runtime"]  # the baseline's stays
    # A setting of int8 holds no other knob to int8, nor the runtime; a fixed runtime is the user's own word.
    loose, free = resolve_space(listed, ctx, fix={"int8_fallback": 2}), resolve_space(listed, ctx)
    assert "onnxruntime" in free.values["runtime"]  # a core dependency, left out above by the hold alone
    assert (loose.values["runtime"], loose.values["ov_precision"]) == (
        free.values["runtime"],
        free.values["ov_precision"],
    )
    assert resolve_space("default", ctx, fix={"compile_mode": "default", "runtime": "torch"}).values["runtime"] == [
        "torch"
    ]


def test_a_toml_file_is_a_space(tmp_path, ctx):
    path = tmp_path / "mine.toml"
    path.write_text('[knobs]\nbatch_size = [8, 16]\namp_dtype = "all"\n')
    space = resolve_space(path, ctx)
    assert space.values["batch_size"] == [32, 8, 16]
    path.write_text("[knobs\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_preset(path)


def test_warm_start_tries_the_usual_recipe_then_each_change_alone(cpu_env):
    from autotune.search.space import warm_start
    from tests.models import TinyCNN, image_data

    _, _, space = autotune.plan(TinyCNN(), image_data(n=512), space="cpu", device="cpu")
    configs = warm_start(space)
    base = space.baseline
    changes = [{k: v for k, v in c.items() if base[k] != v} for c in configs]
    low = {"amp_dtype": "bfloat16"} if cpu_env.bf16 else {}
    assert changes[0] == {**low, "batch_size": 64, "channels_last": True}  # the recipe, all at once
    assert {"batch_size": 64} in changes and {"compile_mode": "default"} in changes  # and one at a time
    assert all(c and all(space.values[k] and v in space.values[k] for k, v in c.items()) for c in changes)
    assert len({json.dumps(c, sort_keys=True) for c in changes}) == len(changes)
    _, _, small = autotune.plan(TinyCNN(), image_data(n=512), space="shrink", device="cpu", objectives="size")
    assert warm_start(small) == []  # size alone: no speed recipe


def test_fixing_int8_searches_its_fallback_and_weight_scales(ctx):
    # A space that fixes int8 and says nothing of its settings would measure every layer in int8
    # only, which ruins accuracy on real models (measured: 15 trials, all over the guard).
    space = resolve_space("default", ctx, fix={"runtime": "onnxruntime", "ort_precision": "int8_dynamic"})
    assert space.values["int8_fallback"] == [0, 1, 2, 4, 8, "auto"]
    assert space.values["int8_per_channel"] == [False, True]
    torch_int8 = resolve_space({"base": None, "quantization": ["none", "int8_dynamic"]}, ctx)
    assert "auto" in torch_int8.values["int8_fallback"]
    # Said otherwise, the space or the fix wins; and without int8 nothing comes along.
    pinned = resolve_space("default", ctx, fix={"quantization": "int8_dynamic", "int8_fallback": 2})
    assert pinned.values["int8_fallback"] == [2]
    listed = resolve_space({"quantization": ["int8_dynamic"], "int8_per_channel": [False]}, ctx)
    assert listed.values["int8_per_channel"] == [False]
    assert resolve_space({"base": None, "batch_size": [8, 16]}, ctx).values["int8_fallback"] == [0]
    # OpenVINO's int8 brings them too (the default space searches it where OpenVINO runs).
    ov = resolve_space({"base": None, "runtime": ["torch", "openvino"], "ov_precision": ["fp32", "int8_static"]}, ctx)
    if "openvino" in ov.values["runtime"]:
        assert "auto" in ov.values["int8_fallback"]
