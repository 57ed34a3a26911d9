"""``jpeg_draft``: JPEG photos decoded at reduced scale where the dataset's own ``__getitem__``
opens them with PIL and first resizes them, judged by the guard; PNGs, small JPEGs and corrupt
files are read as before."""

from __future__ import annotations

import pytest
import torch

import autotune
from autotune.config import Config
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.decode import DraftedDataset, DraftRule, drafted, probe
from autotune.trial.build import build, make_loader, read_samples
from benchmarks.vision.photos import LightCNN, PhotoFolder, eval_transform, make_photos


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    make_photos(folder, 6)
    return PhotoFolder(folder)


class Sizes(PhotoFolder):
    """Records the size PIL hands over after the decode: what was decoded."""

    seen: list = []

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.paths[i]) as image:
            rgb = image.convert("RGB")
            Sizes.seen.append(rgb.size)
            return eval_transform(rgb), 0


def test_real_photos_decode_smaller_with_the_same_output_shape_and_close_values(photos):
    rule = probe(photos)
    assert rule == DraftRule(shorter=256)
    sizes = Sizes(photos.paths[0].parent)
    Sizes.seen.clear()
    full = [sizes[i][0] for i in range(len(sizes))]
    reduced = [DraftedDataset(sizes, rule)[i][0] for i in range(len(sizes))]
    decoded_full, decoded_small = Sizes.seen[: len(sizes)], Sizes.seen[len(sizes) :]
    for big, small in zip(decoded_full, decoded_small, strict=True):
        assert small[0] < big[0] and min(small) >= 256  # a DCT scale, still as large as the resize needs
    for a, b in zip(full, reduced, strict=True):
        assert a.shape == b.shape == (3, 224, 224)
        # The same picture: a resize from the DCT-scaled image is a little sharper than PIL's
        # antialiased one from the full decode (about 5 levels of 255 on average); the guard
        # judges what that does to the model's outputs.
        assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.97
        assert (a - b).abs().mean() < 0.15


def test_pngs_and_small_jpegs_are_left_alone(tmp_path, photos):
    from PIL import Image

    png = tmp_path / "png"
    png.mkdir()
    for i, path in enumerate(photos.paths[:3]):
        Image.open(path).save(png / f"p{i}.png")
    assert probe(PhotoFolder(png)) is None  # no JPEG decoded
    small = tmp_path / "small"
    small.mkdir()
    for i, path in enumerate(photos.paths[:3]):
        Image.open(path).resize((400, 300)).save(small / f"s{i}.jpg", quality=90)
    assert probe(PhotoFolder(small)) is None  # the resize needs more than half of it
    big_rule = DraftRule(shorter=256)
    assert big_rule.request(400, 300) is None
    with drafted(big_rule):  # a JPEG too small to scale decodes at full size
        assert Image.open(small / "s0.jpg").convert("RGB").size == (400, 300)


def test_a_crop_before_the_resize_keeps_the_full_decode(photos):
    class CropFirst(PhotoFolder):
        def __getitem__(self, i):
            from PIL import Image

            with Image.open(self.paths[i]) as image:
                return eval_transform(image.convert("RGB").crop((0, 0, 800, 800))), 0

    assert probe(CropFirst(photos.paths[0].parent)) is None


def test_a_corrupt_file_raises_what_it_raises_without_the_lever(tmp_path, photos):
    data = photos.paths[0].read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jpg").write_bytes(data[: len(data) // 3])  # cut off mid-scan
    folder = PhotoFolder(bad)
    errors = []
    for dataset in (folder, DraftedDataset(folder, DraftRule(shorter=256))):
        with pytest.raises(Exception) as raised:
            dataset[0]
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1]


def test_offered_where_the_probe_found_a_rule(cpu_env):
    data = describe([(torch.zeros(3, 8, 8), 0)] * 4)
    knob = get_knob("jpeg_draft")
    assert knob.offer(SpaceContext(cpu_env, data, 8)).values == [False]
    found = SpaceContext(cpu_env, data, 8, jpeg="shorter side 256")
    assert knob.offer(found).values == [False, True]


def test_the_build_and_the_user_loader_read_the_photos_drafted(photos):
    state = build(torch.nn.Identity(), Config({"batch_size": 4, "jpeg_draft": True}), "cpu")
    loader = make_loader(photos, state)
    assert isinstance(loader.dataset, DraftedDataset)
    assert make_loader(photos, state).dataset is loader.dataset  # one wrapper per build
    user = autotune.dataloader(photos, {"batch_size": 4, "jpeg_draft": True, "num_workers": 2})
    got = torch.cat([x for x, _ in user])
    want = torch.stack([DraftedDataset(photos, DraftRule(shorter=256))[i][0] for i in range(len(photos))])
    assert torch.equal(got, want)  # in loader workers too


@pytest.mark.slow  # a short search on real photos
def test_a_search_over_photos_picks_reduced_scale_and_its_claim_says_so(photos, tmp_path):
    result = autotune.optimize(LightCNN().eval(), photos, space={"base": None, "jpeg_draft": [False, True]},
                               baseline_batch_size=2, n_trials=2, out_dir=tmp_path, export=(), device="cpu",
                               measure={"n_windows": 2, "window_s": 0.2, "warmup_batches": 1})  # fmt: skip
    assert result.best_config["jpeg_draft"] is True
    assert "reduced scale" in result.claim


def test_the_guard_reads_samples_as_a_drafted_configurations_loader_does(photos):
    """The validation samples of a configuration that reads its JPEGs at reduced scale are the
    drafted ones: the guard judges the decode's change, not the full decode's samples again."""
    drafted = build(torch.nn.Identity(), Config({"batch_size": 4, "jpeg_draft": True}), "cpu")
    plain = build(torch.nn.Identity(), Config({"batch_size": 4}), "cpu")
    got = read_samples(photos, range(3), drafted)
    want = [DraftedDataset(photos, DraftRule(shorter=256))[i] for i in range(3)]
    assert all(torch.equal(g[0], w[0]) for g, w in zip(got, want, strict=True))
    assert not torch.equal(got[0][0], photos[0][0])  # drafted pixels differ from the full decode's
    assert all(torch.equal(g[0], photos[i][0]) for i, g in enumerate(read_samples(photos, range(3), plain)))


def test_a_drafted_trial_is_judged_on_its_own_decode(photos, tmp_path):
    result = autotune.optimize(
        LightCNN().eval(), photos, space={"base": None, "jpeg_draft": [False, True]}, fix={"jpeg_draft": True},
        baseline_batch_size=2, n_trials=2, out_dir=tmp_path, export=(), device="cpu", isolation="inprocess",
        measure={"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0},
    )  # fmt: skip
    drafted = [t.user_attrs for t in result.study.trials if t.user_attrs.get("config", {}).get("jpeg_draft")]
    assert drafted and drafted[0]["status"] == "ok", drafted
    assert drafted[0]["metric_drop"] > 0  # 0 exactly when the guard re-read the full decode's samples


class Logged(PhotoFolder):
    """Writes, for every read, the process that read the sample and the width PIL decoded."""

    def __init__(self, folder, log):
        super().__init__(folder)
        self.log = log

    def __getitem__(self, i):
        import os

        from PIL import Image

        with Image.open(self.paths[i]) as image:
            rgb = image.convert("RGB")
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {rgb.size[0]}\n")
        return eval_transform(rgb), 0


def _reads(log):
    return [tuple(map(int, line.split())) for line in log.read_text().split("\n") if line] if log.exists() else []


def _narrowest_full_decode(logged, log):
    """The narrowest width of the photos decoded at full scale (the log emptied after)."""
    for i in range(len(logged)):
        logged[i]
    full = min(w for _, w in _reads(log))
    log.unlink()
    return full


def test_building_the_user_loader_reads_each_photo_looked_at_once_and_drafted(photos, tmp_path):
    log = tmp_path / "reads"
    logged = Logged(photos.paths[0].parent, log)
    full = _narrowest_full_decode(logged, log)
    autotune.dataloader(logged, {"batch_size": 2, "jpeg_draft": True})
    reads = _reads(log)
    # The probe's samples (full decodes), then one look at each sample the batching checks (of
    # six photos, all of them), read as the loader reads them: drafted.
    assert len(reads) == 3 + len(photos), reads
    assert all(w < full for _, w in reads[3:]), (reads, full)


def test_a_loaded_artifact_reads_photos_as_the_winner_did_drafted_in_loader_workers(photos, tmp_path):
    """``load(out).predict(samples)`` of a winner with ``jpeg_draft`` and loader workers reads the
    photos at reduced scale in worker processes while the artifact runs, as its trials timed it
    (it read them one by one in the caller, at full scale: 0.67 of the claim on 160 photos)."""
    import os

    from autotune.deploy.load import Predictor

    log = tmp_path / "reads"
    logged = Logged(photos.paths[0].parent, log)
    full = _narrowest_full_decode(logged, log)
    model = torch.jit.trace(LightCNN().eval(), torch.zeros(2, 3, 224, 224))
    pred = Predictor(model, "torchscript", tmp_path / "model.pt", {"input_names": ["input_0"]}, 2, "cpu")
    pred.run = {"config": {"batch_size": 2, "jpeg_draft": True, "num_workers": 2}, "data": {"collate": "default"}}
    got = pred.predict(logged)
    in_workers = [w for pid, w in _reads(log) if pid != os.getpid()]
    assert len(in_workers) == len(photos), _reads(log)  # every photo read once, by a loader worker
    assert all(w < full for w in in_workers)  # at reduced scale
    drafted = DraftedDataset(photos, DraftRule(shorter=256))
    with torch.inference_mode():
        want = LightCNN().eval()(torch.stack([drafted[i][0] for i in range(len(photos))]))
    assert torch.allclose(torch.stack([torch.as_tensor(g) for g in got]), want, atol=1e-4)
