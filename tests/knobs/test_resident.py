"""``device_resident``: the samples copied to the device once and each batch gathered there; the
data path (gather, feeder, residency) in training too. On the CPU the copy stays in host memory,
which runs the same logic; the CUDA tests check the device side."""

import dataclasses

import pytest
import torch

import autotune
from autotune.config import Config
from autotune.data import describe
from autotune.errors import InputError, TrialError
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.gather import GatheredDataset
from autotune.knobs.resident import fits, resident
from autotune.trial.build import build, make_loader
from autotune.trial.train_setup import FixedOrder
from tests.knobs.test_gather import DATASETS, _assert_same
from tests.models import image_data


class Decoded(torch.utils.data.Dataset):
    """Samples made in ``__getitem__`` (as a decoder makes them): not rows of any tensor."""

    def __init__(self, n=29):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        gen = torch.Generator().manual_seed(i)
        return torch.rand(3, 4, 4, generator=gen) * 255, i % 3


def _loaders(dataset, drop_last=False, **values):
    plain = build(torch.nn.Identity(), Config({"batch_size": 8, **values}), "cpu")
    kept = build(torch.nn.Identity(), Config({"batch_size": 8, **values, "device_resident": True}), "cpu")
    return make_loader(dataset, plain, drop_last=drop_last), make_loader(dataset, kept, drop_last=drop_last)


@pytest.mark.parametrize("name", ["TensorDataset", "rows as a dict", "list of (image, int)", "list of tensors"])
def test_resident_batches_equal_the_per_sample_ones(name):
    dataset = DATASETS[name]()
    for drop_last in (False, True):
        plain, kept = _loaders(dataset, drop_last)
        assert isinstance(kept.dataset, GatheredDataset)
        _assert_same(list(kept), list(plain))


def test_decoded_samples_are_read_once_and_stacked():
    dataset = Decoded()
    plain = make_loader(dataset, build(torch.nn.Identity(), Config({"batch_size": 8}), "cpu"))
    want = list(plain)
    reads = dataset.reads
    state = build(torch.nn.Identity(), Config({"batch_size": 8, "device_resident": True}), "cpu")
    got = [list(make_loader(dataset, state)) for _ in range(3)]  # three loaders of one build
    assert dataset.reads - reads == len(dataset)  # each sample decoded once, for every pass
    for epoch in got:
        _assert_same(epoch, want)


def test_the_loader_reads_in_this_process_whatever_the_workers_knob_says():
    plain, kept = _loaders(image_data(20), num_workers=2, pin_memory=True, prefetch_factor=4)
    assert plain.num_workers == 2 and kept.num_workers == 0 and not kept.pin_memory
    _assert_same(list(kept), list(plain))
    # Workers, their settings, pinning, gather and the cache do not apply: one config key for all.
    a = Config({"device_resident": True, "num_workers": 2, "prefetch_factor": 4, "gather": "batched"})
    assert a.key() == Config({"device_resident": True}).key()


def test_shuffled_training_batches_are_indexed_on_the_copy():
    data = image_data(40)
    order = FixedOrder(40, 8, seed=3)
    plain = torch.utils.data.DataLoader(data, batch_size=8, sampler=order)
    copy = resident(data, "cpu")
    kept = torch.utils.data.DataLoader(copy, batch_size=8, sampler=order, collate_fn=lambda b: b)
    a, b = iter(plain), iter(kept)
    for _ in range(7):  # past the first epoch
        _assert_same(next(b), next(a))


def test_samples_that_do_not_fit_or_do_not_stack_are_refused_with_the_reason():
    data = image_data(64)  # 64 x 3 x 8 x 8 float32 + labels: about 50 KiB
    with pytest.raises(TrialError, match=r"device_resident: the samples take .* GiB, more than 50%") as raised:
        resident(data, "cpu", free=10_000)
    assert raised.value.kind == "unsupported"
    ragged = [torch.zeros(3, 8, 8 + i % 2) for i in range(10)]
    with pytest.raises(TrialError, match="cannot be stacked"):
        resident(ragged, "cpu")
    assert fits(100, 1000) is None


def test_the_user_loader_keeps_the_samples_where_the_config_says():
    data = image_data(20)
    loader = autotune.dataloader(data, {"batch_size": 8, "device_resident": True, "num_workers": 2})
    assert isinstance(loader.dataset, GatheredDataset) and loader.num_workers == 0
    _assert_same(list(loader), list(torch.utils.data.DataLoader(data, batch_size=8)))
    with pytest.raises(InputError, match=r"cannot be stacked.*device_resident=False"):
        mixed = [torch.zeros(2, dtype=torch.float64 if i == 5 else torch.float32) for i in range(6)]
        autotune.dataloader(mixed, {"batch_size": 2, "device_resident": True})


def test_offered_on_cuda_for_repeated_passes_over_default_collated_samples(cpu_env):
    data = describe(image_data())
    knob = get_knob("device_resident")
    assert knob.offer(SpaceContext(cpu_env, data, 8, repeated_passes=True)).values == [False]
    cuda = dataclasses.replace(cpu_env, device="cuda:0", device_mem_bytes=80 * 2**30)
    assert knob.offer(SpaceContext(cuda, data, 8, repeated_passes=True)).values == [False, True]
    once = knob.offer(SpaceContext(cuda, data, 8, repeated_passes=False))
    assert once.values == [False] and "repeated_passes=True" in once.excluded["true"]
    small = dataclasses.replace(cuda, device_mem_bytes=1000)
    assert "GiB" in knob.offer(SpaceContext(small, data, 8, repeated_passes=True)).excluded["true"]
    padded = dataclasses.replace(data, collate="user")
    assert knob.offer(SpaceContext(cuda, padded, 8, repeated_passes=True)).values == [False]


# --- training gets the data path --------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [{"gather": "batched"}, {"feed_ahead": 2}, {"device_resident": True}, {"gather": "batched", "feed_ahead": 4}],
    ids=["gather", "feeder", "resident", "gather+feeder"],
)
def test_training_reads_the_same_micro_batches_through_the_data_path(values):
    from autotune.trial.train_setup import prepare

    data = image_data(48)

    def setup(extra):
        return prepare(
            torch.nn.Linear(3, 3), Config({"batch_size": 8, **extra}), "cpu", lambda p: torch.optim.SGD(p, lr=0.1),
            data, sampler=FixedOrder(48, 8, seed=1),
        )  # fmt: skip

    plain, tuned = setup({}), setup(values)
    a, b = iter(plain.loader), iter(tuned.loader)
    for _ in range(9):  # across an epoch's end
        _assert_same(next(b), next(a))
    del b


def test_the_users_training_loop_runs_on_the_tuned_data_path():
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = [(x[i], (x[i, 0] > 0).long()) for i in range(64)]  # learnable: the sign of a feature
    config = {"batch_size": 8, "gather": "batched", "feed_ahead": 2}
    torch.manual_seed(0)
    t = autotune.training(torch.nn.Linear(8, 2), (torch.optim.SGD, {"lr": 0.5}), data, config, device="cpu")
    assert len(t.loader) == 8 and t.loader.ahead == 2

    def loss_fn(out, batch):
        return torch.nn.functional.cross_entropy(out, batch[1])

    losses = []
    for _ in range(4):  # epochs: each one a new pass of the feeder
        batches = iter(t.loader)
        losses += [t.step(batches, loss_fn).item() for _ in range(len(t.loader))]
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < first


# --- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["TensorDataset", "rows as a dict", "list of (image, int)"])
def test_resident_batches_on_cuda_equal_the_per_sample_ones(name):
    dataset = DATASETS[name]()
    plain = build(torch.nn.Identity(), Config({"batch_size": 8}), "cuda:0")
    kept = build(torch.nn.Identity(), Config({"batch_size": 8, "device_resident": True}), "cuda:0")
    got = list(make_loader(dataset, kept))
    for leaf in (t for b in got for t in (b.values() if isinstance(b, dict) else b) if isinstance(t, torch.Tensor)):
        assert leaf.is_cuda
    want = list(make_loader(dataset, plain))
    _assert_same([_cpu(b) for b in got], want)


@pytest.mark.gpu
def test_a_dataset_already_on_the_gpu_works_with_every_data_path_knob():
    x = torch.randn(40, 3, 8, 8, device="cuda:0")
    y = torch.arange(40, device="cuda:0") % 4
    dataset = torch.utils.data.TensorDataset(x, y)
    config = {"batch_size": 8, "gather": "batched", "pin_memory": True, "num_workers": 2, "feed_ahead": 2}
    state = build(torch.nn.Identity(), Config({**config, "device_prefetch": True}), "cuda:0")
    got = list(make_loader(dataset, state))
    assert len(got) == 5 and got[0][0].is_cuda
    assert torch.equal(torch.cat([b[0] for b in got]), x) and torch.equal(torch.cat([b[1] for b in got]), y)
    user = list(autotune.dataloader(dataset, config, device="cuda:0"))
    assert torch.equal(torch.cat([b[0] for b in user]), x)


def _cpu(batch):
    from autotune.samples import map_tensors

    return map_tensors(lambda t: t.cpu(), batch)


def test_a_resident_winners_claim_names_what_it_assumes():
    from autotune.run.output import _run_claim

    base = {"config": {"batch_size": 8}, "samples_per_s": 100.0, "key": "a"}
    best = {"config": {"batch_size": 8, "device_resident": True}, "samples_per_s": 300.0, "key": "b"}
    claim = _run_claim({"mode": "inference"}, base, best, None, False, None)
    assert "samples kept on the device" in claim["assumes"] and "read again" in claim["sentence"]
    assert "assumes" not in _run_claim({"mode": "train"}, base, best, None, False, None)  # epochs read them again
