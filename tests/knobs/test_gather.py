"""``gather``: batches of tensor-backed samples read with one index per tensor, equal to the
batches ``__getitem__`` + ``default_collate`` make."""

import collections
import time

import pytest
import torch

from autotune.config import Config
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.gather import GatheredDataset, gathered
from autotune.trial.build import build, make_loader
from tests.models import TinyCNN, image_data

Pair = collections.namedtuple("Pair", "image label")


class Rows(torch.utils.data.Dataset):
    """Samples that are rows of tensors the dataset holds, as ``make(i)`` arranges them; counts reads."""

    def __init__(self, n=37, make=None):
        gen = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, 4, 4), dtype=torch.uint8, generator=gen)
        self.labels = torch.arange(n) % 5
        self.make = make or (lambda s, i: {"image": s.images[i], "label": s.labels[i]})
        self.reads = 0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        self.reads += 1
        return self.make(self, i)


def _per_sample_and_batched(dataset, **values):
    """The batches of the per-sample and of the batched loader of one configuration."""
    loaders = []
    drop_last = values.pop("drop_last", False)
    for gather in ("per_sample", "batched"):
        state = build(torch.nn.Identity(), Config({**values, "gather": gather}), "cpu")
        loaders.append(make_loader(dataset, state, drop_last=drop_last))
    assert isinstance(loaders[1].dataset, GatheredDataset)  # the batched path was taken
    return list(loaders[0]), list(loaders[1])


def _assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)


DATASETS = {
    "TensorDataset": lambda: torch.utils.data.TensorDataset(torch.randn(37, 3, 4, 4), torch.arange(37)),
    "rows as a dict": lambda: Rows(),
    "rows as a named tuple": lambda: Rows(make=lambda s, i: Pair(s.images[i], s.labels[i])),
    "rows alone": lambda: Rows(make=lambda s, i: s.images[i]),
    "list of (image, label)": lambda: image_data(37),
    "list of tensors": lambda: [torch.full((2, 3), float(i)) for i in range(37)],
    "list of (image, int)": lambda: [(torch.randn(5), i % 3) for i in range(37)],
    "list of dicts with floats": lambda: [{"x": torch.randn(4).double(), "w": 0.5 * i} for i in range(37)],
}


@pytest.mark.parametrize("name", DATASETS)
def test_batched_batches_equal_the_per_sample_ones(name):
    dataset = DATASETS[name]()
    per_sample, batched = _per_sample_and_batched(dataset, batch_size=8)
    assert len(per_sample) == len(batched) == 5  # the short last batch too
    _assert_same(per_sample, batched)


def test_batched_batches_equal_the_per_sample_ones_with_workers_and_dropped_last():
    per_sample, batched = _per_sample_and_batched(Rows(), batch_size=16, num_workers=1, drop_last=True)
    assert len(batched) == 2
    _assert_same(per_sample, batched)


def test_batched_batches_are_trimmed_as_the_per_sample_ones():
    ids = torch.randint(1, 100, (24, 12))
    mask = torch.ones(24, 12, dtype=torch.long)
    mask[:, 7:] = 0  # every sequence padded after 7 tokens
    data = Rows(24, lambda s, i: {"input_ids": ids[i], "attention_mask": mask[i]})
    data.ids, data.mask = ids, mask
    per_sample, batched = _per_sample_and_batched(data, batch_size=8, padding="trim")
    assert batched[0]["input_ids"].shape == (8, 7)
    _assert_same(per_sample, batched)


def test_a_batch_is_read_without_the_datasets_getitem():
    data = Rows(n=64)
    state = build(torch.nn.Identity(), Config({"batch_size": 8, "gather": "batched"}), "cpu")
    loader = make_loader(data, state)
    checked = data.reads  # the check that the samples are rows, once per build
    assert sum(len(b["label"]) for _ in range(3) for b in make_loader(data, state)) == 3 * 64
    assert data.reads == checked and len(loader) == 8


NOT_ROWS = {
    "a tensor made in __getitem__": lambda s, i: {"image": s.images[i].float() / 255, "label": s.labels[i]},
    "rows in another order": lambda s, i: {"image": s.images[(i * 7) % len(s)], "label": s.labels[i]},
    "a number": lambda s, i: {"image": s.images[i], "label": int(s.labels[i])},
}


@pytest.mark.parametrize("name", NOT_ROWS)
def test_samples_that_are_not_rows_are_read_per_sample(name, cpu_env):
    data = Rows(make=NOT_ROWS[name])
    assert gathered(data) is None
    offer = get_knob("gather").offer(SpaceContext(cpu_env, describe(data), 8))
    assert offer.values == ["per_sample"] and "not rows of tensors" in offer.excluded["batched"]
    state = build(torch.nn.Identity(), Config({"batch_size": 8, "gather": "batched"}), "cpu")
    assert make_loader(data, state).dataset is data  # the value is harmless: the per-sample loader


def test_lists_whose_samples_differ_in_dtype_are_not_stacked():
    # default_collate promotes per batch: float64 for a batch holding one double, float32 for
    # the others; one stacked tensor would make every batch float64.
    data = [torch.zeros(3, dtype=torch.float64 if i == 0 else torch.float32) for i in range(16)]
    assert gathered(data) is None


def test_offered_for_tensor_rows_and_in_memory_lists_only(cpu_env, monkeypatch):
    knob = get_knob("gather")
    tensors = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.arange(64))
    assert knob.offer(SpaceContext(cpu_env, describe(tensors), 8)).values == ["per_sample", "batched"]
    assert knob.offer(SpaceContext(cpu_env, describe(image_data()), 8)).values == ["per_sample", "batched"]
    assert knob.baseline(SpaceContext(cpu_env, describe(tensors), 8)) == "per_sample"
    user = knob.offer(SpaceContext(cpu_env, describe(image_data(), torch.utils.data.default_collate), 8))
    assert user.values == ["per_sample"] and "collate_fn" in user.excluded["batched"]
    # A machine whose memory's quarter is under the 64 images' 48 KiB.
    monkeypatch.setattr("autotune.env.host_memory_bytes", lambda: 4 * 64 * 3 * 8 * 8)
    big = knob.offer(SpaceContext(cpu_env, describe(image_data()), 8))
    assert big.values == ["per_sample"] and "stacking the samples once" in big.excluded["batched"]
    assert gathered(image_data(), max_bytes=1000) is None


def test_batched_runs_faster_than_per_sample_on_small_samples():
    # Per sample, a batch of 256 costs 256 __getitem__ calls and a stack of 512 small tensors;
    # batched, two index_select calls. The margin (2x) is far under the ratio on any CPU.
    data = torch.utils.data.TensorDataset(torch.randn(4096, 16), torch.arange(4096))
    seconds = {}
    for gather in ("per_sample", "batched"):
        loader = make_loader(data, build(torch.nn.Identity(), Config({"batch_size": 256, "gather": gather}), "cpu"))
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _batch in loader:
                pass
            runs.append(time.perf_counter() - start)
        seconds[gather] = min(runs)
    assert seconds["batched"] < seconds["per_sample"] / 2, seconds


def test_the_user_loader_gathers_the_same_batches():
    import autotune

    data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.arange(20))
    plain = autotune.dataloader(data, {"batch_size": 8})
    fast = autotune.dataloader(data, {"batch_size": 8, "gather": "batched"})
    assert isinstance(fast.dataset, GatheredDataset) and not isinstance(plain.dataset, GatheredDataset)
    _assert_same(list(plain), list(fast))
    shuffled = autotune.dataloader(data, {"batch_size": 8, "gather": "batched"}, shuffle=True)
    assert sorted(torch.cat([y for _, y in shuffled]).tolist()) == list(range(20))
    own = autotune.dataloader(data, {"batch_size": 8, "gather": "batched"}, collate_fn=lambda b: torch.tensor(len(b)))
    assert [int(n) for n in own] == [8, 8, 4]  # a collate of the user's gets samples, as it expects


def test_the_gathered_model_outputs_equal_the_per_sample_ones():
    data = image_data(24)
    model = TinyCNN().eval()
    outs = {}
    for gather in ("per_sample", "batched"):
        state = build(model, Config({"batch_size": 8, "gather": gather}), "cpu")
        with torch.inference_mode():
            outs[gather] = torch.cat([state.model(x) for x, _ in make_loader(data, state)])
    torch.testing.assert_close(outs["per_sample"], outs["batched"], rtol=0, atol=0)


@pytest.mark.gpu
def test_batched_gathers_straight_into_pinned_memory():
    data = Rows(n=64)
    state = build(torch.nn.Identity(), Config({"batch_size": 8, "gather": "batched", "pin_memory": True}), "cuda")
    loader = make_loader(data, state)
    made = []
    gather = loader.dataset.__getitems__
    loader.dataset.__getitems__ = lambda ids: made.append(gather(ids)) or made[-1]
    batch = next(iter(loader))
    assert batch["image"].is_pinned() and batch["label"].is_pinned()
    # The loader's pinning found the batch pinned already: no second copy of it.
    assert batch["image"].data_ptr() == made[0]["image"].data_ptr()
