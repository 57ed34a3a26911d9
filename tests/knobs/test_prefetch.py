"""``device_prefetch``: batches copied to a CUDA device one batch ahead on a side stream; on the
CPU a pass-through."""

import dataclasses
import time

import pytest
import torch

import autotune
from autotune.config import Config
from autotune.data import describe, to_device
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.prefetch import DevicePrefetcher
from autotune.trial.build import build, make_loader
from autotune.trial.measure import MeasureSettings, measure, timing_batches
from tests.models import TinyCNN, image_data


def test_offered_on_cuda_only(cpu_env):
    data = describe(image_data())
    on_cpu = get_knob("device_prefetch").offer(SpaceContext(cpu_env, data, 8))
    assert on_cpu.values == [False] and "CUDA" in on_cpu.excluded["true"]
    cuda = dataclasses.replace(cpu_env, device="cuda:0")  # the knob reads only the device
    assert get_knob("device_prefetch").offer(SpaceContext(cuda, data, 8)).values == [False, True]


def test_on_the_cpu_it_passes_the_loaders_batches_through():
    loader = torch.utils.data.DataLoader(image_data(10), batch_size=4)
    prefetched = DevicePrefetcher(loader, "cpu")
    assert len(prefetched) == 3 and prefetched.batch_size == 4 and prefetched.dataset is loader.dataset
    for (x, y), (px, py) in zip(loader, prefetched, strict=True):
        assert torch.equal(x, px) and torch.equal(y, py) and px.device.type == "cpu"


def test_make_loader_wraps_the_loader_and_the_timing_loop_reads_it():
    prefetch_only = build(TinyCNN(), Config({"batch_size": 8, "device_prefetch": True}), "cpu")
    assert isinstance(make_loader(image_data(20), prefetch_only), torch.utils.data.DataLoader)  # no copy here
    state = build(TinyCNN(), Config({"batch_size": 8, "device_prefetch": True, "feed_ahead": 2}), "cpu")
    loader = make_loader(image_data(20), state)
    assert isinstance(loader, DevicePrefetcher) and len(loader) == 3
    batches, _ = timing_batches(image_data(20), state, 1)
    assert [len(next(batches)[0]) for _ in range(4)] == [8, 8, 4, 8]  # epoch after epoch
    batches.close()
    result = measure(state, image_data(20), MeasureSettings(n_windows=2, window_s=0.01, warmup_batches=1))
    assert result["samples_per_s"] > 0 and result["n_windows"] == 2
    plain = build(TinyCNN(), Config({"batch_size": 8}), "cpu")
    assert isinstance(make_loader(image_data(20), plain), torch.utils.data.DataLoader)  # off: the loader itself


def test_moving_a_batch_to_its_own_device_copies_nothing():
    batch = [torch.randn(2, 3), {"y": torch.arange(2)}]
    moved = to_device(batch, torch.device("cpu"), non_blocking=True)
    assert moved[0] is batch[0] and moved[1]["y"] is batch[1]["y"]


def test_the_user_loader_prefetches_only_for_a_cuda_device():
    data = image_data(10)
    config = {"batch_size": 4, "device_prefetch": True}
    assert isinstance(autotune.dataloader(data, config), torch.utils.data.DataLoader)  # no device: off
    assert isinstance(autotune.dataloader(data, config, device="cpu"), torch.utils.data.DataLoader)


# --- CUDA -------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_yields_cuda_batches_equal_to_the_source_copied_on_a_side_stream(monkeypatch):
    import autotune.knobs.prefetch as prefetch

    streams = []

    def spy(batch, device, non_blocking=False):
        streams.append(torch.cuda.current_stream(device))
        return to_device(batch, device, non_blocking=non_blocking)

    monkeypatch.setattr(prefetch, "to_device", spy)
    loader = torch.utils.data.DataLoader(image_data(20), batch_size=8, pin_memory=True)
    got = list(DevicePrefetcher(loader, "cuda:0"))
    assert len(got) == len(streams) == 3
    for (x, y), (gx, gy) in zip(loader, got, strict=True):
        assert gx.device.type == gy.device.type == "cuda"
        assert torch.equal(x, gx.cpu()) and torch.equal(y, gy.cpu())
    default = torch.cuda.default_stream(torch.device("cuda:0"))
    assert all(s != default for s in streams)  # every copy was issued on the side stream


@pytest.mark.gpu
def test_the_timing_loops_copy_of_a_prefetched_batch_is_a_no_op():
    state = build(TinyCNN(), Config({"batch_size": 8, "device_prefetch": True, "pin_memory": True}), "cuda:0")
    x, y = next(iter(make_loader(image_data(20), state)))
    moved = to_device([x, y], torch.device(state.device), non_blocking=state.non_blocking)
    assert x.is_cuda and moved[0] is x and moved[1] is y


@pytest.mark.gpu
def test_copies_overlap_the_models_work():
    # Batches of 64 MiB from pinned memory; the "model" is a GPU sleep as long as one copy.
    # Copied on the model's stream, copy and sleep take turns; prefetched, they overlap.
    device = torch.device("cuda:0")
    batches = [torch.randn(16, 1024, 1024).pin_memory() for _ in range(8)]
    batches[0].to(device)  # the first copy and the first sleep pay one-time costs: not timed
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    batches[0].to(device, non_blocking=True)
    end.record()
    end.synchronize()
    copy_ms = start.elapsed_time(end)
    cycles = _sleep_cycles(copy_ms)

    def run(source):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for batch in source:
            torch.cuda._sleep(cycles)
            batch.sum()  # the model reads the batch
        torch.cuda.synchronize()
        return time.perf_counter() - began

    plain = min(run(b.to(device, non_blocking=True) for b in batches) for _ in range(3))
    ahead = min(run(DevicePrefetcher(batches, device)) for _ in range(3))
    assert ahead < 0.8 * plain, (ahead, plain, copy_ms)


def _sleep_cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spends in about ``ms`` milliseconds here."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return max(1, int(1_000_000 * ms / start.elapsed_time(end)))


# --- feed_ahead: the batches made on a background thread ------------------------------------------


def _feeder_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "autotune-feeder"]


@pytest.mark.parametrize("name", ["TensorDataset", "rows as a dict", "rows as a named tuple", "list of (image, int)"])
@pytest.mark.parametrize("gather", ["per_sample", "batched"])
def test_fed_batches_equal_the_loaders_own_in_order(name, gather):
    from tests.knobs.test_gather import DATASETS, _assert_same

    dataset = DATASETS[name]()
    plain = build(torch.nn.Identity(), Config({"batch_size": 8, "gather": gather}), "cpu")
    fed = build(torch.nn.Identity(), Config({"batch_size": 8, "gather": gather, "feed_ahead": 2}), "cpu")
    for drop_last in (False, True):
        want = list(make_loader(dataset, plain, drop_last=drop_last))
        loader = make_loader(dataset, fed, drop_last=drop_last)
        assert isinstance(loader, DevicePrefetcher) and len(loader) == len(want)
        _assert_same(list(loader), want)
    assert not _feeder_threads()


def test_fed_batches_keep_the_users_collate_and_loader_workers():
    def collate(samples):
        return {"x": torch.stack([s[0] for s in samples]) * 2, "n": len(samples)}

    data = image_data(21)
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, collate_fn=collate)
    got = list(DevicePrefetcher(loader, "cpu", ahead=4))
    want = list(torch.utils.data.DataLoader(data, batch_size=4, collate_fn=collate))
    assert [b["n"] for b in got] == [4, 4, 4, 4, 4, 1]
    assert all(torch.equal(g["x"], w["x"]) for g, w in zip(got, want, strict=True))


def test_a_loop_that_stops_early_leaves_no_thread_nor_loader_worker_behind():
    import multiprocessing

    loader = torch.utils.data.DataLoader(image_data(200), batch_size=2, num_workers=2)
    batches = iter(DevicePrefetcher(loader, "cpu", ahead=2))
    next(batches), next(batches)
    assert len(_feeder_threads()) == 1
    batches.close()  # what a ``break`` out of a for loop does, or dropping the iterator
    assert not _feeder_threads()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()


def test_an_endless_loader_stops_with_its_consumer():
    from autotune.trial.train_setup import FixedOrder

    loader = torch.utils.data.DataLoader(image_data(16), batch_size=4, sampler=FixedOrder(16, 4, seed=0))
    batches = iter(DevicePrefetcher(loader, "cpu", ahead=2))
    assert [len(next(batches)[0]) for _ in range(10)] == [4] * 10  # epoch after epoch
    del batches
    import gc

    gc.collect()
    assert not _feeder_threads()


class _BadSample(torch.utils.data.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 13:
            raise ValueError(f"sample {i} is corrupt")
        return torch.zeros(2)


def test_an_error_in_the_feeder_reaches_the_consumer_with_its_own_traceback():
    import traceback

    loader = torch.utils.data.DataLoader(_BadSample(), batch_size=4)
    seen = []
    with pytest.raises(ValueError, match="sample 13 is corrupt") as raised:
        for batch in DevicePrefetcher(loader, "cpu", ahead=2):
            seen.append(len(batch))
    assert seen == [4, 4, 4]  # every batch before the bad one, in order
    frames = [f.name for f in traceback.extract_tb(raised.value.__traceback__)]
    assert "__getitem__" in frames  # where it was raised, not only where it was re-raised
    assert not _feeder_threads()


def test_the_user_loader_feeds_ahead_where_the_config_says_so():
    data = image_data(10)
    loader = autotune.dataloader(data, {"batch_size": 4, "feed_ahead": 2})
    assert isinstance(loader, DevicePrefetcher) and loader.ahead == 2 and len(loader) == 3
    want = list(torch.utils.data.DataLoader(data, batch_size=4))
    assert all(torch.equal(g[0], w[0]) for g, w in zip(loader, want, strict=True))


def test_feed_ahead_is_offered_on_cuda_only(cpu_env):
    data = describe(image_data())
    on_cpu = get_knob("feed_ahead").offer(SpaceContext(cpu_env, data, 8))
    assert on_cpu.values == [0] and "workers" in on_cpu.excluded["2"]
    cuda = dataclasses.replace(cpu_env, device="cuda:0")
    assert get_knob("feed_ahead").offer(SpaceContext(cuda, data, 8)).values == [0, 2, 4]


@pytest.mark.gpu
def test_fed_batches_reach_cuda_in_order_from_the_feeder_thread():
    loader = torch.utils.data.DataLoader(image_data(40), batch_size=8, pin_memory=True)
    got = list(DevicePrefetcher(loader, "cuda:0", ahead=2))
    assert len(got) == 5 and all(x.is_cuda and y.is_cuda for x, y in got)
    for (x, y), (gx, gy) in zip(loader, got, strict=True):
        assert torch.equal(x, gx.cpu()) and torch.equal(y, gy.cpu())
    assert not _feeder_threads()
