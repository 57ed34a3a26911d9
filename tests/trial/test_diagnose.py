"""Why it won: the loader and the model timed apart, and the sentence that explains the winner."""

import json
import time

import pytest
import torch
from torch import nn

import autotune
from autotune.config import Config
from autotune.trial.build import build
from autotune.trial.diagnose import classify, diagnose_run, diagnose_state, explain, window_for
from autotune.trial.measure import MeasureSettings
from tests.models import MLP, classification_data

SETTINGS = MeasureSettings(n_windows=2, window_s=0.1, warmup_batches=1)


class SleepyData(torch.utils.data.Dataset):
    """Decoding each sample takes 5 ms: no model is that slow on 16 features, even on a busy machine."""

    def __init__(self, n: int = 48) -> None:
        self.samples = classification_data(n)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        time.sleep(0.005)
        return self.samples[i]


class Heavy(nn.Module):
    """Forty 512 x 512 matmuls per batch: far slower than stacking in-memory samples."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 512)
        self.weight = nn.Parameter(torch.randn(512, 512) / 512**0.5)
        self.out = nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(40):
            h = torch.tanh(h @ self.weight)
        return self.out(h)


def test_a_slow_dataset_is_data_bound():
    # One thread: a busy machine slows a multi-threaded tiny model by spinning, not this test.
    state = build(MLP(), Config({"batch_size": 8, "num_threads": 1}), "cpu")
    diag = diagnose_state(state, SleepyData(), SETTINGS)
    assert diag["bound"] == "data-bound"
    assert diag["loader_samples_per_s"] < 240  # at most 200 samples/s at 5 ms each, plus timer slack
    assert diag["model_samples_per_s"] > 2 * diag["loader_samples_per_s"]
    assert diag["batch_size"] == 8 and diag["window_s"] == window_for(SETTINGS)


def test_a_heavy_model_on_in_memory_data_is_compute_bound():
    state = build(Heavy(), Config({"batch_size": 32, "num_threads": 1}), "cpu")
    diag = diagnose_state(state, classification_data(256), SETTINGS)
    assert diag["bound"] == "compute-bound"
    assert diag["loader_samples_per_s"] > 5 * diag["model_samples_per_s"]


def test_classify_calls_halves_within_the_margin_balanced():
    assert classify(410, 2900) == "data-bound"
    assert classify(2900, 410) == "compute-bound"
    assert classify(1000, 1140) == classify(1140, 1000) == "balanced"
    assert classify(1000, 1200) == "data-bound"


def test_explain_names_the_knobs_that_acted_on_the_bound_half():
    sentence = explain(
        {"loader_samples_per_s": 410, "model_samples_per_s": 2900, "bound": "data-bound"},
        {"loader_samples_per_s": 3100, "model_samples_per_s": 2950, "bound": "balanced"},
        {"num_workers": 0, "pin_memory": False, "amp_dtype": "float32"},
        {"num_workers": 4, "pin_memory": False, "amp_dtype": "bfloat16"},
    )
    assert sentence.startswith(
        "baseline was data-bound: 410 samples/s from the loader vs 2,900 from the model "
        "(no loader workers: loading took 88% of its time); num_workers=4 raised the loader to 3,100"
    )
    assert "amp_dtype" not in sentence  # a model knob does not explain a faster loader
    compute = explain(
        {"loader_samples_per_s": 9800, "model_samples_per_s": 2900, "bound": "compute-bound"},
        {"loader_samples_per_s": 9000, "model_samples_per_s": 7400, "bound": "compute-bound"},
        {"batch_size": 32, "num_workers": 0, "amp_dtype": "float32"},
        {"batch_size": 128, "num_workers": 2, "amp_dtype": "bfloat16"},
    )
    assert "batch_size=128, amp_dtype=bfloat16 raised the model to 7,400" in compute
    assert "num_workers" not in compute
    # A compute-bound baseline without workers still names a loader that took a real share of its
    # time (CRAFT over page scans: 13 pages/s loading, 10 from the model, 43% of the time loading).
    serial = explain(
        {"loader_samples_per_s": 13, "model_samples_per_s": 10, "bound": "compute-bound"},
        {"loader_samples_per_s": 18000, "model_samples_per_s": 21, "bound": "compute-bound"},
        {"num_workers": 0, "cache_decoded": False},
        {"num_workers": 0, "cache_decoded": True},
    )
    assert "(no loader workers: loading took 43% of its time)" in serial
    assert "(no loader workers: loading took 23% of its time)" in compute
    # The decoded-sample cache acts on the loader (CRAFT over 16x scans, data-bound: the sentence
    # had said "no loader knob changed" beside a loader 3,500x faster).
    cached = explain(
        {"loader_samples_per_s": 6, "model_samples_per_s": 10, "bound": "data-bound"},
        {"loader_samples_per_s": 21062, "model_samples_per_s": 21, "bound": "compute-bound"},
        {"num_workers": 0, "cache_decoded": False, "amp_dtype": "float32"},
        {"num_workers": 0, "cache_decoded": True, "amp_dtype": "bfloat16"},
    )
    assert "; cache_decoded=True raised the loader to 21,062;" in cached and "amp_dtype" not in cached
    same = {"batch_size": 32}
    diag = {"loader_samples_per_s": 100, "model_samples_per_s": 900, "bound": "data-bound"}
    assert explain(diag, diag, same, same).endswith("so it is also the winner")


def test_a_failed_diagnosis_is_recorded_not_raised():
    from autotune.trial.inprocess import InProcessRunner
    from autotune.trial.spec import WorkerSpec

    _, _, space = autotune.plan(MLP(), classification_data(), space="quick", device="cpu", baseline_batch_size=8)
    spec = WorkerSpec(
        model=MLP(),
        dataset=classification_data(),
        metric=None,
        device="cpu",
        baseline=space.baseline,
        val_indices=list(range(16)),
        measure=SETTINGS,
    )
    runner = InProcessRunner(spec)
    baseline = {"config": space.baseline, "key": "a"}
    broken = {"config": {**space.baseline, "batch_size": -1}, "key": "b"}
    diag = diagnose_run(runner, baseline, broken)
    assert diag["baseline"]["bound"] in ("data-bound", "compute-bound", "balanced")
    assert "batch_size" in diag["error"] and "summary" not in diag


@pytest.mark.slow  # an end-to-end study: outside CI's time, run with -m slow
def test_optimize_records_a_data_bound_baseline(tmp_path):
    result = autotune.optimize(
        MLP(),
        SleepyData(),
        space={"base": None, "batch_size": [8, 16]},
        out_dir=tmp_path,
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=2,
        n_val=8,
        n_verify_pairs=1,
        device="cpu",
        isolation="inprocess",
        export=(),
    )
    saved = json.loads((tmp_path / "best_config.json").read_text())["diagnosis"]
    assert saved == result.diagnosis
    assert saved["baseline"]["bound"] == "data-bound"
    assert saved["summary"].startswith("baseline was data-bound: ")


@pytest.mark.gpu
def test_on_cuda_both_halves_are_timed_with_pinned_batches():
    state = build(Heavy(), Config({"batch_size": 32, "pin_memory": True}), "cuda")
    diag = diagnose_state(state, classification_data(256), SETTINGS)
    assert diag["loader_samples_per_s"] > 0 and diag["model_samples_per_s"] > 0
    assert diag["bound"] in ("data-bound", "compute-bound", "launch-bound", "balanced")


class _CostByLength(nn.Module):
    """Costs 1 ms per token position, as a transformer's cost follows its batch's length."""

    def forward(self, x):
        time.sleep(0.001 * x.shape[1])
        return x.float().sum(dim=1)


def test_the_model_alone_is_timed_over_the_timed_batches_not_the_longest_alone():
    # Of text grouped by length, the first planned batch is the longest: timed alone it made a
    # 990 samples/s winner's model look like 323/s, and the diagnosis a fault.
    from autotune.trial.diagnose import model_samples_per_s

    state = build(_CostByLength(), Config({"batch_size": 4}), "cpu")
    batches = [torch.ones(4, 40)] + [torch.ones(4, 10)] * 3
    longest = model_samples_per_s(state, batches[:1], 0.2)
    mixed = model_samples_per_s(state, batches, 0.2)
    # 4 samples per 40 ms alone; 16 samples per 70 ms over the four.
    assert mixed > 1.6 * longest, (mixed, longest)


def test_the_model_alone_reads_the_whole_epoch_the_timing_reads(monkeypatch):
    """A sample of an epoch's batches costs what its batches cost: 8 of CRAFT's 32 pages of
    different sizes made its model 20 pages/s against 22 end to end, called a fault. The model
    is timed over every batch of the epoch the timing reads."""
    import functools

    import autotune.trial.diagnose as diagnose
    from autotune.batching import lengths_of, pad_collate
    from autotune.knobs.state import BuildExtras
    from tests.models import TextEncoder, text_data

    data = text_data(384)  # 12 batches of 32, of different lengths
    extras = BuildExtras(collate_fn=functools.partial(pad_collate, pad_values={}), lengths=lengths_of(data))
    state = build(
        TextEncoder(), Config({"batch_size": 32, "padding": "trim", "length_grouping": 4}), "cpu", extras=extras
    )
    taken = []
    monkeypatch.setattr(diagnose, "model_samples_per_s", lambda s, batches, *a, **k: taken.extend(batches) or 1.0)
    diagnose_state(state, data, MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1))
    assert len(taken) == 12 and sum(len(b["input_ids"]) for b in taken) == len(data)
    widths = sorted(b["input_ids"].shape[1] for b in taken)
    assert widths[0] < widths[-1]  # short batches and long ones alike
