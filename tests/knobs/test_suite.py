"""The suite every knob passes: registered, values JSON-safe, applying keeps the forward pass
working, configs round-trip. A new knob is covered by registering it."""

import json

import pytest
import torch

from autotune.config import Config
from autotune.data import describe
from autotune.knobs import REGISTRY, SpaceContext, Stage, get_knob
from autotune.knobs.state import BuildExtras
from autotune.trial.build import build, make_loader, settings_active
from autotune.trial.measure import call_model
from tests.models import TinyCNN, image_data

KNOBS = list(REGISTRY)


# Knobs that change the model itself: checked for a working forward pass, not for equal outputs.
COMPRESSION = {"prune_ratio", "prune_method", "finetune_steps", "quantization"}


@pytest.fixture(scope="module")
def ctx(cpu_env):
    # Every objective and a loss: the context in which every value of every knob is offered.
    return SpaceContext(cpu_env, describe(image_data()), 8, objectives=("throughput", "size"), has_loss_fn=True)


def extras():
    batch = torch.utils.data.default_collate(image_data(8))
    loss = lambda out, b: torch.nn.functional.cross_entropy(out, b[1])  # noqa: E731
    return BuildExtras(example=batch, calibration=[batch], loss_fn=loss, train_dataset=image_data(), batch_size=8)


@pytest.mark.parametrize("name", KNOBS)
def test_registered_under_its_name_with_help(name):
    knob = get_knob(name)
    assert knob.name == name and isinstance(knob.stage, Stage)
    assert knob.help
    assert knob.default is None or knob.validate(knob.default) == knob.default


@pytest.mark.parametrize("name", KNOBS)
def test_offered_values_and_reasons_are_json_safe(name, ctx):
    offer = get_knob(name).offer(ctx)
    assert offer.values, "a knob offers at least one value"
    assert json.loads(json.dumps(offer.values)) == offer.values
    assert all(isinstance(k, str) and isinstance(v, str) and v for k, v in offer.excluded.items())
    assert get_knob(name).baseline(ctx) in offer.values or name == "batch_size"


@pytest.mark.parametrize("name", KNOBS)
def test_every_offered_value_keeps_the_forward_pass_working(name, ctx):
    model = TinyCNN().eval()
    batch = torch.utils.data.default_collate(image_data(8))
    with torch.no_grad():
        expected = model(batch[0])
    for value in get_knob(name).offer(ctx).values:
        if name == "compile_mode" and value != "none":
            continue  # compiled forward passes: tests/knobs/test_compiler.py (slow)
        values = {name: value}
        if name in ("prune_method", "finetune_steps"):
            values["prune_ratio"] = 0.3  # they act on a pruned model only
        state = build(model, Config(values), "cpu", extras=extras())
        with settings_active(state.settings), torch.inference_mode():
            out = call_model(state.model, batch)
            assert next(iter(make_loader(image_data(8), state)))[0].shape[1:] == (3, 8, 8)
        assert out.shape == expected.shape and out.dtype == torch.float32
        if name not in COMPRESSION:
            torch.testing.assert_close(out, expected, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("name", KNOBS)
def test_config_round_trips_through_json_and_cli_text(name, ctx):
    for value in get_knob(name).offer(ctx).values:
        cfg = Config({name: value})
        assert Config.from_json(cfg.to_json()) == cfg
        assert get_knob(name).parse(json.dumps(value).strip('"')) == value
