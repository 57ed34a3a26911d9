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


def test_a_worker_on_cuda_n_makes_it_the_current_device(monkeypatch):
    """Events and streams made without a device are the current device's: a model on cuda:1 timed
    with events of device 0 read about 0 ms (a false "launch-bound"). There is no second GPU
    here, so the call CUDA would get is what is checked."""
    import torch

    from autotune.env import use_device

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    use_device("cpu")
    use_device("cuda:1")
    assert calls == [torch.device("cuda:1")]


@pytest.mark.gpu
def test_a_trial_context_on_the_last_gpu_makes_it_current():
    import torch

    from autotune.config import Config
    from autotune.trial.context import Context
    from autotune.trial.spec import WorkerSpec
    from tests.models import MLP, classification_data

    last = torch.cuda.device_count() - 1
    spec = WorkerSpec(model=MLP(), dataset=classification_data(32), metric=None, device=f"cuda:{last}",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(8)))  # fmt: skip
    Context(spec)
    assert torch.cuda.current_device() == last
