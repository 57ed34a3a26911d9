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


def test_usable_cpus_are_the_affinity_capped_by_a_cgroup_v2_quota(tmp_path, monkeypatch):
    from autotune.env import usable_cpus

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    assert usable_cpus(str(tmp_path)) == 6  # no quota file: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path)) == 6  # no limit
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert usable_cpus(str(tmp_path)) == 1  # 1.5 CPUs of quota keep one busy
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(str(tmp_path)) == 1  # at least one
    (tmp_path / "cpu.max").write_text("1600000 100000\n")
    assert usable_cpus(str(tmp_path)) == 6  # a quota above the affinity does not add CPUs


def test_usable_cpus_read_a_cgroup_v1_quota(tmp_path, monkeypatch):
    from autotune.env import usable_cpus

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(str(tmp_path)) == 3
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cpus(str(tmp_path)) == 8
