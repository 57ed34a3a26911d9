import json

import pytest

from autotune.env import Env, resolve_device
from autotune.errors import ConfigError


def test_cpu_env_manifest_is_json(cpu_env):
    manifest = cpu_env.manifest()
    assert json.loads(json.dumps(manifest))["device"] == "cpu"
    assert manifest["versions"]["torch"] and manifest["cpu_threads"] >= 1
    assert not cpu_env.fp16 and cpu_env.hardware_key().startswith("cpu")


def test_cuda_where_there_is_none_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available here"):
        resolve_device("cuda")


@pytest.mark.gpu
def test_cuda_env():
    env = Env.detect("cuda")
    assert env.is_cuda and env.fp16 and env.gpu_name and env.gpu_capability >= (3, 0)
