"""Images of many widths behind the user's own collate, which pads each batch to its widest: a
text-line recognizer whose output length follows the width tunes, exports and predicts."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

import autotune
from autotune.errors import InputError
from tests.models import LineRecognizer, line_data, pad_to_widest

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_a_recognizer_over_images_of_many_widths_tunes_and_predicts(tmp_path):
    samples = line_data(40)
    loader = DataLoader(samples, batch_size=8, collate_fn=pad_to_widest)
    autotune.optimize(
        LineRecognizer(),
        loader,
        space={"base": None},
        fix={"batch_size": 16},  # batches of other widths than the baseline's
        n_trials=2,
        out_dir=tmp_path,
        export=("onnx",),
        device="cpu",
        isolation="inprocess",
        measure=FAST,
        n_verify_pairs=2,
    )
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["config"]["batch_size"] == 16
    onnx = best["artifacts"]["onnx"]
    assert onnx["status"] == "ok" and onnx["parity"]["ok"], onnx
    assert autotune.verify(tmp_path)["artifacts"]["onnx"]["status"] == "ok"

    outputs = autotune.predict(LineRecognizer(), loader, tmp_path, device="cpu")
    assert len(outputs) == len(samples)
    with torch.inference_mode():
        for k in range(len(samples)):
            # Each sample's output, in dataset order: its own positions as the batch padded them.
            batch = pad_to_widest(samples[k - k % 16 : k - k % 16 + 16])[0]
            own = LineRecognizer()(batch[k % 16 : k % 16 + 1])[0]
            torch.testing.assert_close(outputs[k], own, atol=1e-4, rtol=1e-3)


class WideFails(LineRecognizer):
    """Runs on the first samples, fails on images wider than 40."""

    def forward(self, x):
        if x.shape[-1] > 40:
            raise RuntimeError("Sizes of tensors must match except in dimension 0")
        return super().forward(x)


def test_a_failure_while_setting_up_says_in_one_line_what_to_change(tmp_path):
    samples = sorted(line_data(24), key=lambda s: s[0].shape[-1])
    with pytest.raises(InputError) as caught:
        autotune.optimize(
            WideFails(),
            DataLoader(samples, batch_size=8, collate_fn=pad_to_widest),
            space={"base": None},
            n_trials=1,
            out_dir=tmp_path,
            export=(),
            device="cpu",
            isolation="inprocess",
            measure=FAST,
        )
    text = str(caught.value)
    assert "\n" not in text and text.startswith("Running the baseline on the validation samples failed")
    assert "To fix it, check that the model runs on a batch of any few samples" in text


@pytest.mark.slow  # an end-to-end run: outside CI's time, run with -m slow
def test_pages_of_many_sizes_batched_by_autotune_come_back_cropped_in_order(tmp_path):
    from tests.models import HalfMap, page_data

    samples = page_data(32)
    autotune.optimize(
        HalfMap(),
        samples,
        space={"base": None},
        fix={"image_padding": "largest_16", "size_grouping": 4},
        n_trials=2,
        out_dir=tmp_path,
        export=("onnx",),
        device="cpu",
        isolation="inprocess",
        measure=FAST,
        n_verify_pairs=2,
        baseline_batch_size=8,
    )
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["data"]["collate"] == "image" and best["artifacts"]["onnx"]["status"] == "ok", best["artifacts"]
    outputs = autotune.predict(HalfMap(), samples, tmp_path, device="cpu")
    # The exported artifact, served: the same batching, each map cut back to its own page.
    served = autotune.load(tmp_path).predict(samples)
    with torch.inference_mode():
        for (x, _), got, artifact in zip(samples, outputs, served, strict=True):
            want = HalfMap()(x[None])[0]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            assert artifact.shape == want.shape
            torch.testing.assert_close(artifact, want, atol=1e-4, rtol=1e-3)
