"""Every trial on a device says whether its pipeline feeds the chip: the model alone beside the end to end."""

import pytest
import torch

from autotune.config import Config
from autotune.trial.build import build
from autotune.trial.diagnose import LAUNCH_BOUND, device_bound, launch_ratio, model_alone
from autotune.trial.measure import MeasureSettings
from tests.models import MLP, classification_data

FAST = MeasureSettings(n_windows=2, window_s=0.05, warmup_batches=1)


def test_a_pipeline_far_below_its_model_alone_is_input_bound():
    # ResNet-50 on an H100 ran ~3,000 img/s end to end for every recipe; the model alone, more
    # than 10,000: the host fed it too slowly, and no model knob could change that.
    assert device_bound(3_000.0, 11_000.0, 0.1) == "input-bound"
    assert device_bound(10_000.0, 11_000.0, LAUNCH_BOUND) == "launch-bound"
    assert device_bound(10_000.0, 11_000.0, None) == "compute-bound"


def test_the_model_alone_runs_on_the_timed_batches_and_names_the_bound():
    state = build(MLP(), Config({"batch_size": 16}), "cpu")
    data = classification_data(128)
    figures = model_alone(state, data, 10.0, FAST)  # an end to end far below any model's speed
    assert figures["model_samples_per_s"] > 10.0 * 1.15
    assert figures["bound"] == "input-bound" and figures["launch_ratio"] is None  # no launches to time on a CPU
    fast = model_alone(state, data, 2 * figures["model_samples_per_s"], FAST)  # fed as fast as it runs
    assert fast["bound"] == "compute-bound"
    assert launch_ratio(state, data[0][0].unsqueeze(0)) is None


@pytest.mark.gpu
def test_on_cuda_a_tiny_model_at_batch_one_is_launch_bound_and_a_large_matmul_is_not():
    tiny = build(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)]), Config({"batch_size": 1}), "cuda")
    assert launch_ratio(tiny, torch.randn(1, 8, device="cuda")) >= LAUNCH_BOUND
    big = build(torch.nn.Linear(4096, 4096), Config({"batch_size": 4096}), "cuda")
    assert launch_ratio(big, torch.randn(4096, 4096, device="cuda")) < LAUNCH_BOUND


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(300)  # a study: worker processes, then the confirmation
def test_a_cuda_trial_records_the_model_alone_and_its_bound(tmp_path):
    import autotune

    result = autotune.optimize(MLP(), classification_data(256), space={"base": None, "batch_size": [16, 64]},
                               n_trials=2, device="cuda", out_dir=tmp_path, export=(), profile=False)  # fmt: skip
    records = [t.user_attrs for t in result.study.trials if t.user_attrs.get("status") == "ok"]
    assert records and all(r["model_samples_per_s"] > 0 for r in records)
    assert all(r["bound"] in ("input-bound", "launch-bound", "compute-bound") for r in records)
