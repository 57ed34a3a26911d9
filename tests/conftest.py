"""One hook: tests marked ``gpu`` are skipped where CUDA is absent (checked when they run, not at
collection). Runs in tests keep their compile cache per run (``OUT/compile-cache``), so a test's
first build is a first build whatever ran before it; tests of the machine-wide cache set their own."""

import os

import pytest

os.environ.setdefault("AUTOTUNE_CACHE_DIR", "run")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


@pytest.fixture(scope="session")
def cpu_env():
    from autotune.env import Env

    return Env.detect("cpu")


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """The output directory of one real, tiny search, shared by the report, show and CLI tests.

    A grid sampler over batch sizes 8-64 and 0-1 loader workers reaches batch 32 or 64 within
    the budget, so the run always holds trials that passed and trials that failed: batch 32 is
    rejected by the guard (wrong outputs), batch 64 runs out of memory.
    """
    import optuna

    import autotune
    from tests.models import Quirky, classification_data

    out = tmp_path_factory.mktemp("finished-run")
    grid = {"batch_size": [8, 16, 32, 64], "num_workers": [0, 1]}
    autotune.optimize(
        Quirky(),
        classification_data(),
        space={"base": None, **grid},
        out_dir=out,
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
        n_verify_pairs=2,
        # Fewer than the 8 grid points even counting trials that are not measured (a repeat of
        # the baseline, one skipped by the out-of-memory rule): a spent grid stops the study.
        n_trials=6,
        n_val=64,
        device="cpu",
        isolation="inprocess",
        export=("onnx", "torchscript"),
        sampler=optuna.samplers.GridSampler(grid, seed=0),
    )
    return out
