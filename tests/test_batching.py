"""autotune.batching: padding collate, trimmed padding, length-grouped batches, outputs per sample."""

import torch

from autotune.batching import Batching, join_samples, pad_collate, split_samples, trim_batch


def _sample(n: int, width: int | None = None) -> dict:
    width = width or n
    ids = torch.zeros(width, dtype=torch.long)
    ids[:n] = torch.arange(1, n + 1)
    mask = torch.zeros(width, dtype=torch.long)
    mask[:n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def test_pad_collate_pads_right_with_each_inputs_pad_value():
    batch = pad_collate([_sample(3), _sample(1)], pad_values={"input_ids": 7})
    assert batch["input_ids"].tolist() == [[1, 2, 3], [1, 7, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]  # the mask always pads with 0


def test_trim_cuts_to_the_longest_real_sequence_and_rounds_up():
    batch = pad_collate([_sample(3, 40), _sample(5, 40)])
    assert trim_batch(batch)["input_ids"].shape == (2, 5)
    assert trim_batch(batch, 8)["attention_mask"].shape == (2, 8)
    assert trim_batch(batch, 64)["input_ids"].shape == (2, 64)  # widened past the batch: see below


def test_trimmed_batches_are_contiguous_so_a_compile_with_symbolic_shapes_builds_one_graph():
    """A trimmed batch was a view whose row stride was the padded width: dynamo guards on strides,
    so a batch needing no cut and one cut to fewer columns each built a graph (real MiniLM: 11 s more)."""
    from torch._dynamo.testing import CompileCounter

    full = pad_collate([_sample(6), _sample(6)])
    cut = [pad_collate([_sample(n, 6), _sample(2, 6)]) for n in (3, 4, 5)]
    assert all(trim_batch(b)["input_ids"].is_contiguous() for b in cut)
    torch._dynamo.reset()
    counter = CompileCounter()
    model = torch.compile(lambda input_ids, attention_mask: (input_ids * attention_mask).sum(1), backend=counter,
                          dynamic=True)  # fmt: skip
    for batch in (full, *cut):
        trimmed = trim_batch(batch)
        model(**trimmed)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_a_batch_padded_to_its_longest_is_widened_to_the_multiple_with_its_pad_values():
    # Natural-length text: the collate pads to each batch's longest, so widths 3, 5, 6 ... would
    # each be a graph of a static compile; trim_8 makes them all 8.
    batch = pad_collate([_sample(3), _sample(5)], pad_values={"input_ids": 7})
    batch["labels"] = torch.tensor([[1, 2, 3, -100, -100], [1, 2, 3, 4, 5]])
    out = trim_batch(batch, 8)
    assert out["input_ids"].shape == (2, 8) and out["input_ids"][0, 3:].eq(7).all()  # its pad id
    assert out["attention_mask"].sum(1).tolist() == [3, 5] and out["attention_mask"][:, 5:].eq(0).all()
    assert out["labels"][:, 5:].eq(-100).all()  # the value at a padded position: the ignore index
    left = {"input_ids": torch.tensor([[0, 4, 4], [4, 4, 4]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    widened = trim_batch(left, 4)
    assert widened["attention_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]  # padded on the left


def test_trim_handles_left_padding():
    mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    batch = {"input_ids": mask * 9, "attention_mask": mask, "labels": torch.tensor([0, 1])}
    out = trim_batch(batch)
    assert out["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert out["labels"].tolist() == [0, 1]


def test_a_grouped_plan_pads_no_more_than_sorting_by_length_does():
    """The short batch of a window held its shortest samples: on 300 real sentences in batches
    of 32, the longest batch padded 32 samples to 71 tokens where sorting by hand padded 12."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(3, 120) for _ in range(300)]
    plan = Batching(batch_size=32, grouping=64, lengths=lengths).plan(len(lengths))

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    ascending = sorted(range(300), key=lambda i: lengths[i])
    by_hand = [ascending[i : i + 32] for i in range(0, 300, 32)]
    assert sorted(i for b in plan for i in b) == list(range(300))
    assert padded(plan) == padded(by_hand)
    assert len(plan[0]) == 300 % 32 and max(lengths[i] for i in plan[0]) == max(lengths)


def test_grouped_plan_sorts_within_windows_and_covers_every_sample_once():
    lengths = [5, 40, 7, 33, 2, 18, 30, 9, 11]
    plan = Batching(batch_size=2, grouping=2, lengths=lengths).plan(len(lengths))
    assert sorted(i for batch in plan for i in batch) == list(range(9))
    assert plan[:2] == [[1, 3], [2, 0]]  # window of 4 samples, longest first
    assert Batching(batch_size=2).plan(5) == [[0, 1], [2, 3], [4]]


def test_per_sample_outputs_keep_real_tokens_and_line_up_across_batchings():
    samples = [_sample(n) for n in (3, 6, 2, 5)]
    model = torch.nn.Embedding(10, 4)

    def outputs(batching: Batching) -> tuple:
        pieces = [None] * len(samples)
        for ids, batch in batching.batches(samples, [3, 6, 2, 5]):
            tokens = model(batch["input_ids"])
            out = {"tokens": tokens, "pooled": (tokens * batch["attention_mask"][..., None]).sum(1)}
            for i, piece in zip(ids, split_samples(out, batch), strict=True):
                pieces[i] = piece
        return join_samples(pieces)

    plain, mask = outputs(Batching(batch_size=4, collate_fn=pad_collate))
    grouped, mask2 = outputs(Batching(batch_size=2, collate_fn=pad_collate, padding="trim", grouping=2))
    assert plain["tokens"].shape == (4, 6, 4) and mask.sum(1).tolist() == [3, 6, 2, 5]
    assert torch.equal(mask, mask2)
    torch.testing.assert_close(plain["tokens"], grouped["tokens"])
    torch.testing.assert_close(plain["pooled"], grouped["pooled"])


def test_pad_collate_pads_a_tokenizers_lists_of_ints():
    from autotune.batching import pad_collate

    batch = pad_collate(
        [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}, {"input_ids": [8], "attention_mask": [1]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    same = pad_collate([{"input_ids": [1, 2], "score": 0.5}, {"input_ids": [3, 4], "score": 1.5}])
    assert same["input_ids"].tolist() == [[1, 2], [3, 4]] and same["score"].tolist() == [0.5, 1.5]
