"""Outputs that change shape from batch to batch: kept batch by batch, judged on the same
batches, stored and read back."""

import pytest
import torch

from autotune.errors import TrialError
from autotune.export.stored import from_stored, to_stored
from autotune.shapes import Batches, run_chunks, same_shapes
from autotune.trial.fidelity import evaluate, fidelity, fidelity_report, infer_kinds
from tests.models import LineRecognizer, line_data, pad_to_widest


def test_run_chunks_keeps_each_batch_as_the_collate_made_it():
    samples = line_data(10)
    out = run_chunks(LineRecognizer(), samples, 4, 3, pad_to_widest, "cpu")
    assert isinstance(out, Batches) and out.chunk == 4 and [len(b) for b in out] == [4, 4, 2]
    for k, batch in enumerate(out):
        widest = max(x.shape[-1] for x, _ in samples[4 * k : 4 * k + 4])
        assert tuple(batch.shape) == (len(batch), widest // 4, 10)
    assert not same_shapes(list(out))
    # Run in slices of 3 padded to 3, the same values as one call on the whole batch.
    whole = LineRecognizer()(pad_to_widest(samples[:4])[0])
    torch.testing.assert_close(out[0], whole.detach())


def test_fidelity_batch_by_batch():
    samples = line_data(12)
    ref = run_chunks(LineRecognizer(), samples, 4, 4, pad_to_widest, "cpu")
    assert fidelity(ref, ref) == pytest.approx(1.0)
    noisy = Batches([b + 0.5 * torch.randn_like(b) for b in ref], chunk=4)
    assert fidelity(noisy, ref) < 0.9
    kinds = infer_kinds(ref, samples, "logits")
    report = fidelity_report(ref, ref, kinds)
    assert report[0]["kind"] == "logits" and report[0]["top1"] == 1.0


def test_changing_shapes_without_a_metric_are_refused_in_one_line():
    ref = Batches([torch.zeros(2, 3), torch.zeros(2, 5)], chunk=2)
    other = Batches([torch.zeros(2, 3), torch.zeros(2, 4)], chunk=2)
    with pytest.raises(TrialError) as caught:
        fidelity(other, ref)
    assert caught.value.kind == "unsupported" and "metric=" in str(caught.value) and "\n" not in str(caught.value)


def test_the_metric_gets_each_batchs_own_outputs():
    samples = line_data(10)
    outputs = run_chunks(LineRecognizer(), samples, 4, 4, pad_to_widest, "cpu")
    seen = []

    def metric(out, batch):
        seen.append((tuple(out.shape[:2]), tuple(batch[1].shape)))
        return 1.0

    assert evaluate(outputs, samples, 4, "cpu", metric, None, collate=pad_to_widest) == 1.0
    assert seen == [(shape, shape) for shape, _ in seen] and len(seen) == 3


def test_stored_and_read_back():
    out = Batches([torch.ones(2, 3), torch.ones(1, 5)], chunk=2)
    back = from_stored(to_stored(out))
    assert isinstance(back, Batches) and back.chunk == 2 and [tuple(b.shape) for b in back] == [(2, 3), (1, 5)]


def test_image_batches_pad_to_a_multiple_and_come_back_in_order_and_cropped():
    from autotune.batching import Batching
    from autotune.shapes import dense_crop, image_sizes, pad_images, size_keys
    from tests.models import HalfMap, page_data

    samples = page_data(20)
    sizes = image_sizes(samples)
    batching = Batching(batch_size=4, collate_fn=pad_images, grouping=2, lengths=size_keys(sizes), image_multiple=16)
    plan = batching.plan(len(samples))
    assert sorted(i for ids in plan for i in ids) == list(range(len(samples)))
    # Within a window, neighbours share an aspect ratio more than in dataset order.
    model, outputs = HalfMap().eval(), [None] * len(samples)
    with torch.inference_mode():
        for ids, (images, _) in batching.batches(samples):
            assert images.shape[-2] % 16 == 0 and images.shape[-1] % 16 == 0
            for i, piece in zip(
                ids, dense_crop(model(images), tuple(images.shape[-2:]), [sizes[i] for i in ids]), strict=True
            ):
                outputs[i] = piece
        for (x, _), got in zip(samples, outputs, strict=True):
            torch.testing.assert_close(got, model(x[None])[0], atol=1e-5, rtol=1e-4)


def test_varying_images_get_autotunes_collate_and_only_then_the_image_knobs(cpu_env):
    from autotune.data import describe
    from autotune.knobs import SpaceContext, get_knob
    from tests.models import image_data, page_data

    varying, fixed = describe(page_data(12)), describe(image_data(12))
    assert (varying.collate, varying.images_vary, fixed.images_vary) == ("image", True, False)
    for name in ("image_padding", "size_grouping"):
        knob = get_knob(name)
        assert len(knob.offer(SpaceContext(cpu_env, varying)).values) == 4
        offer = knob.offer(SpaceContext(cpu_env, fixed))
        assert offer.values == [knob.default] and offer.excluded
