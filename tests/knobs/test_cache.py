"""``cache_decoded``: offered for a dataset that decodes its samples and fits in memory, the
cached dataset gives the same samples, and a run with it completes."""

import json

import pytest
import torch

import autotune
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.cache import CachedDataset
from tests.models import EncodedImages, TinyCNN, image_data

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}


def test_offered_only_for_a_decoding_dataset_that_fits(cpu_env, monkeypatch):
    knob = get_knob("cache_decoded")
    assert knob.offer(SpaceContext(cpu_env, describe(EncodedImages()), repeated_passes=True)).values == [False, True]
    in_list = knob.offer(SpaceContext(cpu_env, describe(image_data()), repeated_passes=True))
    assert in_list.values == [False] and "already in memory" in in_list.excluded["true"]
    rows = knob.offer(SpaceContext(cpu_env, describe(_TensorRows()), repeated_passes=True))
    assert rows.values == [False] and "already in memory" in rows.excluded["true"]  # was offered, and paid nothing
    monkeypatch.setattr("autotune.env._mem_bytes", lambda: 1024)  # a machine with 1 KiB of memory
    too_big = knob.offer(SpaceContext(cpu_env, describe(EncodedImages()), repeated_passes=True))
    assert too_big.values == [False] and "GiB" in too_big.excluded["true"]


class _TensorRows(torch.utils.data.Dataset):
    """Samples that are rows of tensors the dataset holds: nothing is decoded."""

    def __init__(self) -> None:
        self.x, self.y = torch.randn(32, 3, 8, 8), torch.arange(32) % 4

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_in_inference_a_cache_is_offered_only_when_the_user_says_samples_are_read_again(cpu_env):
    """A cache pays on a sample's second read: in serving, over new samples, there is none. On an
    H100 it was offered for every dataset and a noisy 0.63x screening figure banned it."""
    knob = get_knob("cache_decoded")
    once = knob.offer(SpaceContext(cpu_env, describe(EncodedImages())))
    assert once.values == [False] and "repeated_passes=True" in once.excluded["true"]
    _, _, space = autotune.plan(TinyCNN(), EncodedImages(), device="cpu")
    assert space.values["cache_decoded"] == [False]
    _, _, again = autotune.plan(TinyCNN(), EncodedImages(), device="cpu", repeated_passes=True)
    assert again.values["cache_decoded"] == [False, True]


def test_the_cached_dataset_gives_the_same_samples_decoding_each_once():
    get = EncodedImages(6).__getitem__
    reads = []

    class Counting(EncodedImages):
        def __getitem__(self, i):
            reads.append(i)
            return get(i)

    counting = Counting(6)
    cached = CachedDataset(counting)
    for _ in range(3):  # three epochs
        for i in range(len(cached)):
            x, y = cached[i]
            torch.testing.assert_close(x, get(i)[0], rtol=0, atol=0)
            assert int(y) == int(get(i)[1])
    assert sorted(reads) == list(range(6))


@pytest.mark.slow  # the cache itself is unit-tested above
def test_a_run_with_the_cache_completes_and_its_loader_reads_the_same_samples(tmp_path):
    data = EncodedImages(48)
    autotune.optimize(
        TinyCNN(),
        data,
        space={"base": None},
        fix={"cache_decoded": True, "num_workers": 1, "persistent_workers": True},
        n_trials=2,
        out_dir=tmp_path,
        export=(),
        device="cpu",
        measure=FAST,
        n_verify_pairs=2,
        baseline_batch_size=8,
        repeated_passes=True,
    )
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["config"]["cache_decoded"] is True
    # The winner caches: its claim names the assumption it was measured under.
    assert "read again" in best["speedup"]["sentence"] and best["speedup"]["assumes"]
    loader = autotune.dataloader(data, best["config"])
    assert isinstance(loader.dataset, CachedDataset)
    for _ in range(2):  # two epochs, the second from the cache
        got = torch.cat([x for x, _ in loader])
        torch.testing.assert_close(got, torch.stack([data[i][0] for i in range(len(data))]), rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["default", "cpu", "cpu-deploy", "quick", "gpu"])
def test_every_runtime_preset_offers_the_image_and_loader_knobs_where_they_apply(preset):
    """A preset lists its knobs: the decoded-sample cache and the image-size knobs must be among
    them, or a search of a decoding image dataset never tries them (their offers still leave them
    out where they do not apply)."""
    from tests.models import HalfMap, page_data

    _, _, space = autotune.plan(TinyCNN(), EncodedImages(), space=preset, device="cpu", repeated_passes=True)
    assert space.values["cache_decoded"] == [False, True]
    _, _, pages = autotune.plan(HalfMap(), page_data(), space=preset, device="cpu", repeated_passes=True)
    assert len(pages.values["image_padding"]) > 1 and len(pages.values["size_grouping"]) > 1
    assert pages.values["cache_decoded"] == [False]  # a list of samples is in memory already
