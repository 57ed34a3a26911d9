"""Third trust pass on int8 fallback: k beyond the layer count, the auto threshold in the guard's
own terms and on real tokens only, and a ranking that streams, keeps to its budget and persists."""

from __future__ import annotations

import pytest

from autotune.compress.fallback import Int8Plan, torch_with_fallback
from autotune.errors import TrialError
from tests.models import MLP, classification_data


def _batches(samples: list, size: int = 16) -> list:
    from torch.utils.data import default_collate

    return [default_collate(samples[i : i + size]) for i in range(0, len(samples), size)]


@pytest.mark.parametrize("k", [4, 8])
def test_a_fallback_beyond_the_layer_count_is_infeasible_not_an_error(k):
    # MLP has two Linear layers: keeping 4 or 8 float keeps them all, which is no int8 at all.
    # An "unsupported" TrialError is an infeasible trial, which the path rule does not count.
    model = MLP().eval()
    with pytest.raises(TrialError) as caught:
        torch_with_fallback(model, "int8_dynamic", k, _batches(classification_data(64)), Int8Plan(), {})
    assert caught.value.kind == "unsupported"
    assert "keeping 2 layers float leaves none of the 2" in str(caught.value)
