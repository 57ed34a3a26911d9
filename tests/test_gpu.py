"""End-to-end trials on a CUDA device: the GPU knobs, a real CUDA out-of-memory, CUDA graphs."""

import pytest

import autotune
from tests.models import MLP, CudaMemoryHog, TinyCNN, classification_data, image_data

pytestmark = pytest.mark.gpu
FAST = {"n_windows": 2, "window_s": 0.1, "warmup_batches": 2}


def test_gpu_knobs_run_end_to_end(tmp_path):
    space = {
        "base": None,
        "batch_size": [32, 128],
        "amp_dtype": "all",
        "pin_memory": "all",
        "num_workers": [0, 2],
        "channels_last": "all",
        "cudnn_benchmark": "all",
        "tf32": "all",
    }
    result = autotune.optimize(
        TinyCNN(),
        image_data(1024),
        space=space,
        device="cuda",
        out_dir=tmp_path,
        n_trials=10,
        measure=FAST,
        n_verify_pairs=3,
    )
    statuses = {t.user_attrs["status"] for t in result.study.trials}
    assert statuses <= {"ok", "infeasible"}, statuses
    tried = {k: {t.user_attrs["config"][k] for t in result.study.trials} for k in ("amp_dtype", "pin_memory")}
    assert "float16" in tried["amp_dtype"] or "bfloat16" in tried["amp_dtype"]
    assert result.speedup > 0 and result.baseline["peak_mem_mib"] > 0


def test_real_cuda_out_of_memory_is_recorded_and_the_study_goes_on(tmp_path):
    space = {"base": None, "batch_size": [8, 1024, 2048]}
    result = autotune.optimize(
        CudaMemoryHog(),
        classification_data(4096),
        space=space,
        device="cuda",
        out_dir=tmp_path,
        baseline_batch_size=8,
        n_trials=3,
        measure=FAST,
        n_verify_pairs=1,
    )
    by_batch = {t.user_attrs["config"]["batch_size"]: t.user_attrs for t in result.study.trials}
    assert by_batch[1024]["status"] == "oom" or by_batch[2048]["status"] == "oom"
    assert result.best_config["batch_size"] == 8


@pytest.mark.slow
def test_cuda_graph_compile_modes_are_measured(tmp_path):
    space = {"base": None, "compile_mode": ["none", "reduce-overhead"], "amp_dtype": ["float32", "bfloat16"]}
    result = autotune.optimize(
        MLP(),
        classification_data(4096),
        space=space,
        device="cuda",
        out_dir=tmp_path,
        n_trials=4,
        measure=FAST,
        n_verify_pairs=2,
    )
    compiled = [t.user_attrs for t in result.study.trials if t.user_attrs["config"]["compile_mode"] != "none"]
    assert compiled and all(t["status"] in ("ok", "infeasible") for t in compiled)
    assert all(t["compile_s"] > 0 for t in compiled if t["status"] == "ok")
