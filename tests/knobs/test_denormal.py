import torch

import autotune
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.state import BuildState
from autotune.trial.build import settings_active

TINY = 1e-39  # a float32 denormal


def _flushed() -> bool:
    return float(torch.tensor([TINY]) * 1.0) == 0.0


def test_offered_on_the_cpu(cpu_env):
    offer = get_knob("flush_denormal").offer(SpaceContext(cpu_env, describe([torch.zeros(4)]), 32))
    assert offer.values == [False, True]


def test_denormals_flush_only_while_the_model_runs():
    state = BuildState(model=torch.nn.Identity(), device="cpu")
    get_knob("flush_denormal").apply(state, True)
    assert not _flushed()
    with settings_active(state.settings):
        assert _flushed()
    assert not _flushed()  # stock PyTorch again for the next candidate


def test_the_baseline_leaves_denormals_alone():
    state = BuildState(model=torch.nn.Identity(), device="cpu")
    get_knob("flush_denormal").apply(state, False)
    assert state.settings == {}


def test_apply_sets_it_in_the_callers_process():
    try:
        autotune.apply(torch.nn.Linear(4, 2), {"flush_denormal": True}, device="cpu")
        assert _flushed()
    finally:
        torch.set_flush_denormal(False)
