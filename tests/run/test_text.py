"""Text pipelines end to end: samples of natural length, a collate_fn or a DataLoader, trimmed
padding and length-sorted batches, outputs per sample in dataset order."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import autotune
from tests.models import TextEncoder, text_data

# The machine's load must not veto these: they are about what runs, not about the claim.
FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}
COMMON = {"device": "cpu", "isolation": "inprocess", "measure": FAST, "n_verify_pairs": 2}


def _own_outputs(model, samples):
    model = model.eval()
    with torch.inference_mode():
        return [model(**{k: v[None] for k, v in s.items()})[0] for s in samples]


class IgnoresMask(TextEncoder):
    """Pools over every position, padding included: its outputs depend on how much padding there is."""

    def forward(self, input_ids, attention_mask):
        return super().forward(input_ids, torch.ones_like(attention_mask))


@pytest.mark.slow  # CI time: test_pre_padded_text_trims_and_groups_with_the_guard_holding tunes real-length text too
def test_samples_of_natural_length_tune_and_predict_in_dataset_order(tmp_path):
    data = text_data(72)
    result = autotune.optimize(
        TextEncoder(),
        data,
        space="quick",
        # Every candidate, and so the winner, holds these; float32, so that the outputs compare
        # at float32's tolerance whatever this CPU's bfloat16 units make of autocast.
        fix={"length_grouping": 4, "amp_dtype": "float32"},
        n_trials=3,
        out_dir=tmp_path,
        export=(),
        **COMMON,
    )
    assert result.best_config["padding"].startswith("trim") and result.best_config["length_grouping"] == 4
    rows = json.loads((tmp_path / "best_config.json").read_text())
    assert rows["data"] == {"collate": "pad", "pad_values": {}, "sequence": True}
    out = autotune.predict(TextEncoder(), data, result.best_config, device="cpu")
    for got, own in zip(out, _own_outputs(TextEncoder(), data), strict=True):
        torch.testing.assert_close(got, own, atol=1e-5, rtol=1e-4)


def test_a_dataloader_is_the_baseline_with_its_own_batch_size_and_collate(tmp_path):
    from torch.utils.data import DataLoader

    from autotune.batching import pad_collate

    calls = []

    def collate(samples):  # the user's: pads to the batch's longest, as a Hugging Face collator does
        calls.append(len(samples))
        return pad_collate(samples)

    loader = DataLoader(text_data(48), batch_size=12, collate_fn=collate)
    result = autotune.optimize(
        TextEncoder(), loader, space={"base": None}, n_trials=1, out_dir=tmp_path, export=(), **COMMON
    )
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert result.baseline["batch_size"] == 12 and best["data"]["collate"] == "user"
    # The same loader where the tuned pipeline is used: its samples and collate, the tuned batches.
    calls.clear()
    out = autotune.predict(TextEncoder(), loader, tmp_path, device="cpu")
    assert calls  # the loader's own collate made the batches
    for got, own in zip(out, _own_outputs(TextEncoder(), loader.dataset), strict=True):
        torch.testing.assert_close(got, own, atol=1e-5, rtol=1e-4)
    tuned = autotune.dataloader(loader, tmp_path)
    calls.clear()
    assert tuned.dataset is loader.dataset
    assert sum(len(b["input_ids"]) for b in tuned) == 48 and sum(calls) == 48


def test_pre_padded_text_trims_and_groups_with_the_guard_holding(tmp_path):
    data = text_data(64, pad_to=64)
    fixed = {"padding": "trim", "length_grouping": 16}
    result = autotune.optimize(
        TextEncoder(), data, space={"base": None}, fix=fixed, n_trials=2, out_dir=tmp_path, export=(), **COMMON
    )
    trimmed = [t for t in result.study.trials if t.user_attrs.get("config", {}).get("padding") == "trim"]
    assert trimmed and trimmed[0].user_attrs["status"] == "ok"
    assert trimmed[0].user_attrs["metric_drop"] < 1e-4  # the same outputs, sample by sample


def test_a_model_that_ignores_its_mask_cannot_trim(tmp_path):
    data = text_data(64, pad_to=64)
    result = autotune.optimize(
        IgnoresMask(),
        data,
        space={"base": None},
        fix={"padding": "trim"},
        n_trials=2,
        out_dir=tmp_path,
        export=(),
        **COMMON,
    )
    trimmed = [t for t in result.study.trials if t.user_attrs.get("config", {}).get("padding") == "trim"]
    assert trimmed[0].user_attrs["status"] == "infeasible" and trimmed[0].user_attrs["kind"] == "guard"
    assert result.best_config["padding"] == "as_given"


def test_a_user_metric_sees_the_batches_the_collate_makes(tmp_path):
    def metric(outputs, batch):
        assert outputs.shape[0] == batch["input_ids"].shape[0]
        return float(outputs.norm(dim=1).mean())

    result = autotune.optimize(
        TextEncoder(),
        text_data(48),
        metric=metric,
        space={"base": None},
        n_trials=1,
        out_dir=tmp_path,
        export=(),
        **COMMON,
    )
    assert result.baseline["metric"] == pytest.approx(1.0, abs=1e-4)  # unit-norm embeddings


@pytest.mark.slow  # CI time: the Hugging Face test exports text of any length and verifies it too
def test_the_artifacts_take_any_length_and_verify_on_the_winners_batches(tmp_path):
    data = text_data(48)
    fixed = {"padding": "trim_8", "length_grouping": 4}
    autotune.optimize(TextEncoder(), data, space={"base": None}, fix=fixed, n_trials=2, out_dir=tmp_path, **COMMON)
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert {a["status"] for a in best["artifacts"].values()} == {"ok"}
    assert {a["status"] for a in autotune.verify(tmp_path)["artifacts"].values()} == {"ok"}
    own = _own_outputs(TextEncoder(), data)
    for fmt in ("onnx", "torchscript"):
        out = autotune.load(tmp_path, format=fmt).predict(data)
        for got, want in zip(out, own, strict=True):
            torch.testing.assert_close(torch.as_tensor(got), want, atol=1e-4, rtol=1e-3)


def test_lengths_that_nothing_can_batch_name_collate_fn():
    with pytest.raises(autotune.InputError, match="collate_fn"):
        autotune.plan(TextEncoder(), text_data(20, mask=False))
    _, data, space = autotune.plan(TextEncoder(), text_data(20, mask=False), pad_values={"input_ids": 0})
    assert data.collate == "pad" and space.values["length_grouping"] == [0, 4, 16, 64]


@pytest.mark.slow  # the collate in every phase: tests/run/test_collate_phases.py
def test_the_cli_takes_a_collate_fn_from_cfg(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(
        textwrap.dedent(f"""
        from autotune.batching import pad_collate
        from tests.models import TextEncoder, text_data
        model = TextEncoder
        dataset = text_data(48)
        def collate_fn(samples):
            return pad_collate(samples)
        options = {{"measure": {FAST!r}, "n_verify_pairs": 2, "export": (), "isolation": "inprocess"}}
    """)
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "run",
            str(cfg),
            "--trials",
            "2",
            "--out",
            str(tmp_path / "out"),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    best = json.loads((tmp_path / "out" / "best_config.json").read_text())
    assert best["data"]["collate"] == "user" and best["data"]["sequence"] is True


def test_a_user_collate_also_batches_the_guard_for_tuple_samples(tmp_path):
    from torch.nn.utils.rnn import pad_sequence

    gen = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(1, 100, (int(n),), generator=gen), int(n) % 3)
        for n in torch.randint(3, 30, (48,), generator=gen)
    ]

    def collate(samples):  # variable-length id tensors in tuples: the user pads them
        return pad_sequence([s[0] for s in samples], batch_first=True), torch.tensor([s[1] for s in samples])

    model = torch.nn.Sequential(torch.nn.EmbeddingBag(100, 8, mode="sum", padding_idx=0), torch.nn.Linear(8, 3))
    result = autotune.optimize(
        model, data, collate_fn=collate, space={"base": None}, n_trials=1, out_dir=tmp_path, export=(), **COMMON
    )
    assert result.study.trials[0].user_attrs["status"] == "ok"


@pytest.mark.parametrize(
    "fix",
    [
        # Torch's layer ranking on fixed-size inputs runs in tests/compress/test_fallback.py (CI time).
        pytest.param({"quantization": "int8_dynamic", "int8_fallback": 1}, marks=pytest.mark.slow),
        # Calibration batches of different widths: the ONNX ranking's one-layer sessions take any.
        pytest.param(
            {
                "runtime": "onnxruntime",
                "ort_precision": "int8_dynamic",
                "int8_per_channel": True,
                "int8_fallback": "auto",
            },
            marks=pytest.mark.slow,  # ONNX Runtime's layer ranking also runs in tests/compress/test_fallback.py
        ),
    ],
    ids=["torch", "onnxruntime"],
)
def test_int8_fallback_ranks_layers_on_text_of_any_length(tmp_path, fix):
    result = autotune.optimize(
        TextEncoder(), text_data(48), space={"base": None}, fix=fix, n_trials=2, out_dir=tmp_path, export=(), **COMMON
    )
    int8 = result.study.trials[1].user_attrs
    assert int8["kind"] in (None, "guard") and "int8_ranking" in int8, int8.get("reason")
    assert len(int8["int8_kept"]) == (1 if fix["int8_fallback"] == 1 else int8["int8_k"]) < int8["int8_layers"]


def test_a_dataloader_that_samples_a_subset_is_refused_with_the_fix():
    from torch.utils.data import DataLoader, SubsetRandomSampler

    loader = DataLoader(text_data(20, pad_to=48), batch_size=4, sampler=SubsetRandomSampler(range(10)))
    with pytest.raises(autotune.InputError, match="Subset"):
        autotune.plan(TextEncoder(), loader)


def test_a_tokenizers_lists_of_ints_tune_and_predict_without_a_collate(tmp_path):
    data = text_data(40)
    as_lists = [{k: v.tolist() for k, v in s.items()} for s in data]  # what tok(texts) returns
    result = autotune.optimize(
        TextEncoder(), as_lists, space={"base": None}, n_trials=1, out_dir=tmp_path, export=(), **COMMON
    )
    rows = json.loads((tmp_path / "best_config.json").read_text())
    assert rows["data"]["collate"] == "pad" and rows["data"]["sequence"] is True
    out = autotune.predict(TextEncoder(), as_lists, result.best_config, device="cpu")
    for got, own in zip(out, _own_outputs(TextEncoder(), data), strict=True):
        torch.testing.assert_close(got, own, atol=1e-5, rtol=1e-4)
