"""padding and length_grouping: offered for token sequences only, and what each offers when."""

import torch

from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from tests.models import text_data


def _offer(name, cpu_env, samples, **kw):
    ctx = SpaceContext(cpu_env, describe(samples, **kw), 32)
    knob = get_knob(name)
    return knob.offer(ctx), knob.baseline(ctx)


def test_not_offered_without_token_sequences(cpu_env):
    offer, base = _offer("padding", cpu_env, [torch.zeros(4)] * 8)
    assert offer.values == ["as_given"] and base == "as_given" and "token sequences" in offer.excluded["trim"]
    offer, _ = _offer("length_grouping", cpu_env, [torch.zeros(4)] * 8)
    assert offer.values == [0]


def test_pre_padded_text_offers_every_padding(cpu_env):
    offer, base = _offer("padding", cpu_env, text_data(32, pad_to=64))
    assert offer.values == ["as_given", "trim", "trim_8", "trim_16", "trim_32"] and base == "as_given"
    offer, base = _offer("length_grouping", cpu_env, text_data(32, pad_to=64))
    assert offer.values == [0, 4, 16, 64] and base == 0


def test_samples_of_natural_length_start_trimmed(cpu_env):
    offer, base = _offer("padding", cpu_env, text_data(32))
    assert base == "trim" and "as_given" not in offer.values and "trim_16" in offer.values


def test_without_a_mask_nothing_tells_padding_apart(cpu_env):
    offer, base = _offer("padding", cpu_env, text_data(32, mask=False), pad_values={"input_ids": 0})
    assert offer.values == [base] == ["trim"]
    assert "attention_mask" in offer.excluded["trim_8"]


def test_grouping_matters_only_with_trimmed_padding():
    knob = get_knob("length_grouping")
    assert not knob.applies({"padding": "as_given"}) and knob.applies({"padding": "trim_16"})
