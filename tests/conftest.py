"""One hook: tests marked ``gpu`` are skipped where CUDA is absent (checked when they run, not at collection)."""

import pytest


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


@pytest.fixture(scope="session")
def cpu_env():
    from autotune.env import Env

    return Env.detect("cpu")
