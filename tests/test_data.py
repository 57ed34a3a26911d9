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


def test_padding_keeps_whether_a_batch_is_an_inference_tensor():
    # a compiled model guards on it: a short last batch padded into an inference tensor, after
    # full batches that were not, compiled (and captured a CUDA graph) a second time
    plain, batch = torch.randn(20, 16), torch.randn(3, 16)
    with torch.inference_mode():
        inference = torch.randn(3, 16)
        assert not pad_batch(plain[16:], 8).is_inference()
        assert pad_batch(inference, 8).is_inference()
        assert torch.equal(pad_batch(plain[16:], 8)[4:], plain[19:].expand(4, 16))
    assert not pad_batch(batch, 8).is_inference()


def test_validation_subset_is_fixed():
    assert validation_indices(10_000, 64) == validation_indices(10_000, 64)
    assert len(set(validation_indices(10_000, 64))) == 64
    assert validation_indices(5, 64) == [0, 1, 2, 3, 4]


def _tokenized(lengths):
    """Samples as a Hugging Face tokenizer gives them without return_tensors: lists of ints."""
    return [
        {"input_ids": [101, *range(1, n - 1), 102], "token_type_ids": [0] * n, "attention_mask": [1] * n}
        for n in lengths
    ]


def test_a_tokenizers_lists_of_ints_are_token_sequences_padded_automatically():
    info = describe(_tokenized([5, 9, 3, 12]))
    assert info.kind == "dict" and info.collate == "pad"
    assert info.sequence.keys == ("input_ids", "token_type_ids", "attention_mask")
    assert (info.sequence.min_len, info.sequence.max_len, info.sequence.varying) == (3, 12, True)
    assert info.shapes["['input_ids']"] == (-1,)
    # Lists of one length still need the padding collate: default_collate would transpose them.
    assert describe(_tokenized([6, 6])).collate == "pad"


def test_numpy_token_arrays_are_token_sequences():
    import numpy as np

    samples = [{"input_ids": np.arange(n), "attention_mask": np.ones(n, dtype=np.int64)} for n in (4, 7)]
    info = describe(samples)
    assert info.collate == "pad" and info.sequence.max_len == 7


def test_with_a_collate_what_it_makes_is_checked_not_the_samples():
    import pytest

    from autotune.errors import InputError

    def tokenize(texts):  # raw strings in, tensors out: the samples themselves are not tensors
        width = max(len(t) for t in texts)
        return {"input_ids": torch.tensor([[ord(c) for c in t.ljust(width)] for t in texts])}

    assert describe(["a cat", "a dog sat", "hi"], collate_fn=tokenize).collate == "user"
    with pytest.raises(InputError, match=r"^collate_fn failed on the first 2 samples: KeyError"):
        describe(_tokenized([3, 4]), collate_fn=lambda samples: samples[0]["missing"])
    with pytest.raises(InputError, match="return_tensors='pt'"):
        describe(_tokenized([3, 4]), collate_fn=lambda samples: [s["input_ids"] for s in samples])


def test_a_structure_difference_is_named_in_one_short_line_with_the_fix():
    import pytest

    from autotune.errors import InputError

    samples = [{"input_ids": torch.ones(30, dtype=torch.long)}] * 3 + [
        {"input_ids": torch.ones(30, dtype=torch.long), "token_type_ids": torch.zeros(30, dtype=torch.long)}
    ]
    with pytest.raises(InputError) as caught:
        describe(samples)
    text = str(caught.value)
    assert "\n" not in text and len(text) < 300, text
    assert "sample 3 has ['token_type_ids'], which sample 0 lacks" in text and "collate_fn=" in text
