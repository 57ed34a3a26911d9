import torch

from autotune.data import describe, model_inputs, pad_batch, slice_batch, validation_indices


def test_sample_kinds():
    assert describe([torch.zeros(3, 4, 4)] * 2).image_input
    assert describe([(torch.zeros(4), 1)] * 2).kind == "tuple"
    info = describe([{"ids": torch.zeros(8, dtype=torch.long), "mask": torch.ones(8), "labels": torch.tensor(1)}] * 3)
    assert info.kind == "dict" and not info.image_input


def test_dict_batches_pass_inputs_as_keywords_without_the_target():
    batch = {"ids": torch.zeros(2, 8), "mask": torch.ones(2, 8), "labels": torch.zeros(2)}
    args, kwargs = model_inputs(batch)
    assert args == () and set(kwargs) == {"ids", "mask"}
    args, kwargs = model_inputs(((torch.zeros(2, 3), torch.zeros(2, 5)), torch.zeros(2)))
    assert len(args) == 2 and kwargs == {}


def test_padding_then_slicing_restores_the_batch():
    batch = (torch.arange(3.0)[:, None], torch.arange(3))
    padded = pad_batch(batch, 8)
    assert padded[0].shape == (8, 1) and padded[1][-1] == 2
    assert torch.equal(slice_batch(padded, 3)[0], batch[0])


def test_validation_subset_is_fixed():
    assert validation_indices(10_000, 64) == validation_indices(10_000, 64)
    assert len(set(validation_indices(10_000, 64))) == 64
    assert validation_indices(5, 64) == [0, 1, 2, 3, 4]
