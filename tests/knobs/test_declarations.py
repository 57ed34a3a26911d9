"""What the code outside ``autotune/knobs/`` knows of a knob comes from the knob: its values read
by attribute (a misspelt name fails at once) and its declarations, which a knob defined in a test
sets and every reader follows with nothing else naming it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from autotune.config import Config, values_of, with_values
from autotune.errors import ConfigError


def test_a_config_reads_its_knobs_by_attribute_and_a_misspelt_name_fails_at_once():
    cfg = Config(batch_size=64, amp_dtype="bfloat16")
    assert (cfg.batch_size, cfg.amp_dtype, cfg.compile_mode) == (64, "bfloat16", "none")
    with pytest.raises(AttributeError, match=r"No knob named 'batch_sise'.*batch_size"):
        cfg.batch_sise  # noqa: B018
    with pytest.raises(ConfigError, match="amp_dtype"):
        Config(amp_dtype="float8")

    # A change is validated, and keeps the record an int8 winner is rebuilt from.
    rebuilt = Config({"config": {"quantization": "int8_dynamic"}, "rebuild": {"seed": 3}})
    assert rebuilt.but(batch_size=8).rebuild == {"seed": 3} and rebuilt.but(batch_size=8).batch_size == 8
    with pytest.raises(ConfigError, match="compile_mode"):
        rebuilt.but(compile_mode="fastest")

    # It still travels to a worker and copies as before.
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg).batch_size == 64
    assert getattr(cfg, "not_a_knob", None) is None and not hasattr(cfg, "_hidden")


def test_a_stored_config_reads_the_defaults_it_leaves_out_and_changes_by_knob_name():
    stored = {"runtime": "openvino"}  # a trial's config as a record keeps it
    knobs = values_of(stored)
    assert (knobs.runtime, knobs.ov_precision, knobs.batch_size) == ("openvino", "fp32", 32)
    assert values_of(None).compile_mode == "none"
    with pytest.raises(AttributeError, match="No knob named 'ov_precison'"):
        knobs.ov_precison  # noqa: B018

    changed = with_values(stored, ov_precision="bf16")
    assert changed == {"runtime": "openvino", "ov_precision": "bf16"} and stored == {"runtime": "openvino"}
    assert isinstance(with_values(Config(), batch_size=8), Config)
    with pytest.raises(ConfigError, match="No knob named 'ov_precison'"):
        with_values(stored, ov_precison="bf16")


@pytest.fixture
def declaring_knob():
    """A knob added the way a contributor adds one, declaring what the build, the warm-up, the
    parity outputs and the claim ask of it."""
    from autotune.knobs import REGISTRY, Knob, Stage, register

    class Replay(Knob):
        name = "test_replay"
        stage = Stage.RUNTIME
        choices = (False, True)
        default = False
        reads_inputs, numerics, per_shape = True, True, True
        pays_on_repeats = "a replay buffer"
        claim_note = ("replayed", "batches replayed from a buffer", "batches replayed")

        def apply(self, state, value):
            state.settings[self.name] = value

    register(Replay)
    try:
        yield Replay.name
    finally:
        del REGISTRY[Replay.name]


def test_a_new_knobs_declarations_reach_the_build_the_warmup_and_the_claim(declaring_knob):
    from autotune.knobs import declared, off_default
    from autotune.run.output import _run_claim
    from autotune.run.predict import _compiles, _costly
    from autotune.trial.build import build
    from autotune.trial.warmup import compiles_per_shape

    on, off = Config({declaring_knob: True}), Config()
    # Its build makes another model from example inputs: the run keeps them, a predictor warns.
    assert off_default(on, "reads_inputs") == (declaring_knob,) and not off_default(off, "reads_inputs")
    assert _costly(on) and not _costly(off)
    # It does work per input shape: the warm-up runs every shape first, in a trial and in a predictor.
    assert _compiles(on) and not _compiles(off)
    assert compiles_per_shape(build(torch.nn.Linear(4, 2), on, "cpu"))
    assert not compiles_per_shape(build(torch.nn.Linear(4, 2), off, "cpu"))
    # It changes the numbers process-wide: the export does not reuse the parity outputs for it.
    assert declaring_knob in declared("numerics")

    # The claim says what its speed assumes and what was measured.
    base = {"config": off.to_dict(), "samples_per_s": 100.0, "key": "a"}
    best = {"config": on.to_dict(), "samples_per_s": 300.0, "key": "b"}
    claim = _run_claim({"mode": "inference"}, base, best, None, False, None)
    assert "a replay buffer pays there" in claim["assumes"] and claim["replayed"] == "batches replayed from a buffer"
    assert claim["sentence"].endswith("as a replay buffer needs; with batches replayed")
    plain = _run_claim({"mode": "inference"}, base, {**best, "config": off.to_dict()}, None, False, None)
    assert "assumes" not in plain and "replayed" not in plain


def test_the_ddp_knobs_set_the_arguments_they_declare():
    from autotune.trial.ddp_steps import ddp_kwargs

    assert ddp_kwargs(Config(world_size=2, ddp_bucket_cap_mb=5, ddp_static_graph=True), True) == {
        "bucket_cap_mb": 5,
        "gradient_as_bucket_view": False,
        "static_graph": True,
        "broadcast_buffers": True,
        "find_unused_parameters": True,
    }
