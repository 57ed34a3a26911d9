"""The user's collate reaches every phase of a run: trials, confirmation rounds, the "why it won"
diagnosis, held-out scoring, export parity, ``verify``, ``predict``/``predictor`` and
``load().predict``. Samples of natural length, batched only by a collate of the user's that pads
(``default_collate`` cannot stack them)."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

import autotune
from tests.models import TextEncoder, text_data

# The machine's load must not veto these: they are about what runs, not about the claim.
FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}


def pad_to_longest(samples):
    """A collate as users write one: every sequence padded with 0 to the batch's longest."""
    out = {}
    for key in samples[0]:
        out[key] = torch.nn.utils.rnn.pad_sequence([s[key] for s in samples], batch_first=True)
    return out


def _own_outputs(model, samples):
    with torch.inference_mode():
        return [model.eval()(**{k: v[None] for k, v in s.items()})[0] for s in samples]


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_every_phase_batches_with_the_users_collate(tmp_path):
    samples = text_data(40)
    assert len({len(s["input_ids"]) for s in samples}) > 1  # default_collate cannot stack these
    loader = DataLoader(samples, batch_size=8, collate_fn=pad_to_longest)
    result = autotune.optimize(
        TextEncoder(),
        loader,
        space={"base": None},
        # A winner other than the baseline, so that confirmation rounds and the diagnosis run.
        fix={"batch_size": 16},
        n_trials=2,
        test_dataset=text_data(12, seed=1),
        out_dir=tmp_path,
        export=("onnx",),
        device="cpu",
        isolation="inprocess",
        measure=FAST,
        n_verify_pairs=2,
    )
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["data"]["collate"] == "user" and best["config"]["batch_size"] == 16
    speedup = best["speedup"]
    assert speedup["method"] == "confirmation rounds" and speedup["n_rounds"] > 0, speedup
    assert speedup["verdict"] in ("speedup", "none", "slower"), speedup
    assert "error" not in best["diagnosis"] and best["diagnosis"]["best"]["model_samples_per_s"] > 0
    assert result.held_out["n_samples"] == 12 and result.held_out["drop"] < 1e-3
    onnx = best["artifacts"]["onnx"]
    assert onnx["status"] == "ok" and onnx["parity"]["ok"], onnx
    checked = autotune.verify(tmp_path)
    assert checked["artifacts"]["onnx"]["status"] == "ok", checked

    own = _own_outputs(TextEncoder(), samples)
    served = autotune.load(tmp_path)
    for outputs in (
        autotune.predict(TextEncoder(), loader, tmp_path, device="cpu"),
        autotune.predictor(TextEncoder(), tmp_path, dataset=loader, device="cpu")(samples),
        served.predict(samples, collate_fn=pad_to_longest),
        served.predict(loader),
    ):
        assert len(outputs) == len(samples)
        for got, want in zip(outputs, own, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
