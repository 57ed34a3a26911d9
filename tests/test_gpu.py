"""End-to-end trials on a CUDA device: the GPU knobs, a real CUDA out-of-memory, CUDA graphs."""

import json
import os
from pathlib import Path

import pytest
import torch

import autotune
from autotune._pristine import tf32_on
from tests.models import MLP, CudaMemoryHog, TinyCNN, classification_data, image_data

pytestmark = pytest.mark.gpu
FAST = {"n_windows": 2, "window_s": 0.1, "warmup_batches": 2}
# Statuses of a trial that was timed: kept, ruled out by its guard, stopped early as far too slow.
TIMED = ("ok", "infeasible", "stopped")
_SEEN: set[str] = set()  # what this process's KnobProbe forward passes wrote already


class KnobProbe(TinyCNN):
    """TinyCNN that writes down what each forward pass ran under: the dtype its convolution ran
    in, its input's batch size and memory format, cuDNN autotuning and TF32 matmuls. One JSON
    line per distinct combination, in ``log_dir/<pid>.jsonl``: the study's worker processes
    import this class from here and write their own files."""

    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.log_dir = log_dir

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))  # (B, 8, 8, 8)
        seen = {
            "device": x.device.type,
            "batch_size": int(x.shape[0]),
            "amp_dtype": str(y.dtype).removeprefix("torch."),
            "channels_last": x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "tf32": tf32_on(),
        }
        line = json.dumps(seen, sort_keys=True)
        if line not in _SEEN:
            _SEEN.add(line)
            with open(os.path.join(self.log_dir, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(line + "\n")
        return self.head(y.flatten(1))


def _seen(log_dir: Path) -> list[dict]:
    return [json.loads(line) for path in log_dir.glob("*.jsonl") for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(300)  # ten trials, then confirmation rounds in fresh worker processes
def test_gpu_knobs_run_end_to_end(tmp_path):
    knobs = ("amp_dtype", "channels_last", "cudnn_benchmark", "tf32")
    space = {
        "base": None,
        "batch_size": [32, 128],
        "pin_memory": "all",
        "num_workers": [0, 2],
        **dict.fromkeys(knobs, "all"),
    }
    log_dir = tmp_path / "seen"
    log_dir.mkdir()
    data = image_data(1024)
    result = autotune.optimize(
        KnobProbe(str(log_dir)),
        data,
        space=space,
        device="cuda",
        out_dir=tmp_path / "out",
        n_trials=10,
        measure=FAST,
        n_verify_pairs=3,
        export=(),
    )
    attrs = [t.user_attrs for t in result.study.trials]
    timed = [a for a in attrs if a.get("ran") and a.get("samples_per_s")]
    assert timed and all(a["status"] in TIMED for a in timed), [(a["status"], a.get("reason")) for a in timed]
    assert {a["config"]["amp_dtype"] for a in timed} & {"float16", "bfloat16"}, "no 16-bit autocast was timed"
    # Each timed configuration ran in a worker with its knobs in effect: the convolution in the
    # autocast dtype, channels-last inputs, cuDNN autotuning and TF32 as configured.
    seen = _seen(log_dir)
    for a in timed:
        wanted = {"device": "cuda", "batch_size": a["config"]["batch_size"], **{k: a["config"][k] for k in knobs}}
        assert wanted in seen, (wanted, seen)
    # The loader settings, as autotune.dataloader reproduces them: pinned batches, the workers;
    # pinned memory at least once, whether or not the search timed it.
    configs = {json.dumps(c, sort_keys=True) for a in timed for c in (a["config"], {**a["config"], "pin_memory": True})}
    for config in map(json.loads, configs):
        loader = autotune.dataloader(data, config)
        images, _ = next(iter(loader))
        assert images.is_pinned() == config["pin_memory"] and loader.num_workers == config["num_workers"], config
        assert len(images) == config["batch_size"]
    assert result.baseline["peak_mem_mib"] > 0  # CUDA's allocator peak, not the CPU's resident set


@pytest.mark.slow
@pytest.mark.timeout(180)
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
@pytest.mark.timeout(600)  # each compiled candidate compiles in the worker, and again in each confirming process
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
        export=(),
        trial_timeout=240,
    )
    ran = [t.user_attrs for t in result.study.trials if t.user_attrs.get("ran")]
    compiled = [a for a in ran if a["config"]["compile_mode"] == "reduce-overhead"]
    assert compiled, [a["config"] for a in ran]
    assert all(a["status"] in TIMED for a in compiled), [(a["status"], a.get("reason")) for a in compiled]
    measured = [a for a in compiled if a["status"] == "ok"]
    assert measured and all(a["compile_s"] > 0 and a["samples_per_s"] > 0 for a in measured)
