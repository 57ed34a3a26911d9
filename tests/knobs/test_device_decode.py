"""``device_decode``: a torchvision folder dataset's files decoded on the GPU and its transform
run there. torchvision does not import on the CPU build of torch CI installs, so nvJPEG itself is
tested by the ``gpu`` tests at the end (a real ``ImageFolder`` of photos); on the CPU: reading a
transform, the transform's tensor form against PIL's on real photos, the loop over files' bytes
(with PIL decoding where nvJPEG would), where the lever is offered, and the guard reading samples
as a lever's loader reads them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import autotune
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from autotune.knobs.device_decode import (
    DecodePlan,
    DeviceDecoded,
    EncodedFolder,
    encoded_collate,
    plan_for,
    plan_from_steps,
    transform_images,
)
from benchmarks.vision.photos import MEAN, STD, LightCNN, PhotoFolder, make_photos

EVAL = DecodePlan(shorter=256, crop=(224, 224), mean=tuple(MEAN.tolist()), std=tuple(STD.tolist()))
STEPS = [
    ("Resize", {"size": 256, "interpolation": "bilinear", "max_size": None, "antialias": True}),
    ("CenterCrop", {"size": (224, 224)}),
    ("ToTensor", {}),
    ("Normalize", {"mean": MEAN.tolist(), "std": STD.tolist()}),
]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    make_photos(folder, 6)
    return PhotoFolder(folder)


class Folder(torch.utils.data.Dataset):
    """ImageFolder's shape: ``samples`` of (path, target) and a ``target_transform``."""

    def __init__(self, paths, target_transform=None):
        self.samples = [(str(p), i % 3) for i, p in enumerate(paths)]
        self.target_transform = target_transform

    def __len__(self):
        return len(self.samples)


def _pil_uint8(path: Path) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).transpose(2, 0, 1).copy())


def _torchvision_eval(path: Path) -> torch.Tensor:
    """torchvision's Resize(256), CenterCrop(224), ToTensor(), Normalize(...) on a PIL image,
    written out (torchvision does not import here): the shorter side to 256 and the longer
    truncated, PIL's bilinear resize, the crop's corner rounded, 8-bit pixels scaled."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        w, h = image.size
        size = (256, int(256 * h / w)) if w <= h else (int(256 * w / h), 256)
        image = image.resize(size, Image.BILINEAR)
        left, top = round((size[0] - 224) / 2.0), round((size[1] - 224) / 2.0)
        image = image.crop((left, top, left + 224, top + 224))
    array = (np.asarray(image, dtype=np.float32) / 255.0 - MEAN) / STD
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


def _pil_decoder(files):
    """Files' bytes to uint8 (3, H, W) images on the host, where nvJPEG does it on the GPU."""
    import io

    from PIL import Image

    return [
        torch.from_numpy(
            np.asarray(Image.open(io.BytesIO(f.numpy().tobytes())).convert("RGB")).transpose(2, 0, 1).copy()
        )
        for f in files
    ]


def test_torchvisions_evaluation_transform_reads_as_a_plan():
    plan, why = plan_from_steps(STEPS)
    assert why == "" and plan == dataclasses.replace(EVAL, interpolation="bilinear")
    v2 = [STEPS[0], STEPS[1], ("ToImage", {}), ("ToDtype", {"dtype": {torch.Tensor: torch.float32}, "scale": True}),
          STEPS[3]]  # fmt: skip
    assert plan_from_steps(v2)[0] == plan
    assert plan_from_steps([("Resize", {"size": [256]}), ("CenterCrop", {"size": 224}), ("PILToTensor", {})])[0] == (
        DecodePlan(shorter=256, crop=(224, 224), scale=False)
    )


@pytest.mark.parametrize(
    ("steps", "named"),
    [
        ([("RandomResizedCrop", {"size": 224}), ("ToTensor", {})], "RandomResizedCrop"),
        ([("CenterCrop", {"size": 224}), ("Resize", {"size": 256}), ("ToTensor", {})], "Resize"),  # cropped first
        ([("Resize", {"size": 256}), ("ToTensor", {})], "different sizes"),  # nothing makes one size
        ([("Resize", {"size": 256, "antialias": False}), ("CenterCrop", {"size": 224}), ("ToTensor", {})], "antialias"),
        ([("Resize", {"size": 256}), ("CenterCrop", {"size": 224})], "no conversion"),
    ],
)
def test_a_transform_the_device_cannot_run_is_refused_with_its_step_named(steps, named):
    plan, why = plan_from_steps(steps)
    assert plan is None and named in why


def test_the_transform_on_tensors_matches_pils_on_real_photos(photos):
    """The plan's tensor resize (antialiased, rounded to 8 bits), crop and normalisation against
    the same transform in PIL, on 1-2 megapixel JPEGs of several aspect ratios."""
    images = [_pil_uint8(p) for p in photos.paths]
    got = transform_images(images, EVAL)
    want = torch.stack([_torchvision_eval(p) for p in photos.paths])
    assert got.shape == want.shape == (len(photos), 3, 224, 224) and got.dtype == torch.float32
    levels = (got - want).abs() * torch.tensor(STD).view(1, 3, 1, 1) * 255  # in 8-bit levels
    assert float(levels.mean()) < 0.25 and float(levels.max()) < 2.01  # measured: 0.09 and 1 level


def test_images_of_one_size_are_resized_together_and_keep_their_order(photos):
    a, b = _pil_uint8(photos.paths[0]), _pil_uint8(photos.paths[1])
    together = transform_images([a, b, a], EVAL)
    assert torch.equal(together[0], together[2])
    assert torch.allclose(together[1], transform_images([b], EVAL)[0])


def test_the_files_bytes_are_batched_as_they_are_and_decoded_in_order(photos):
    folder = Folder(photos.paths, target_transform=lambda t: t + 10)
    encoded = EncodedFolder(folder)
    data, target = encoded[2]
    assert data.dtype == torch.uint8 and bytes(data.numpy()) == Path(photos.paths[2]).read_bytes() and target == 12
    loader = torch.utils.data.DataLoader(encoded, batch_size=4, collate_fn=encoded_collate, num_workers=2)
    decoded = DeviceDecoded(loader, EVAL, "cpu", decoder=_pil_decoder)
    assert len(decoded) == 2 and decoded.batch_size == 4
    batches = list(decoded)
    assert [b[0].shape[0] for b in batches] == [4, 2]  # the short last batch kept
    assert torch.cat([b[1] for b in batches]).tolist() == [10 + i % 3 for i in range(len(photos))]
    want = transform_images([_pil_uint8(p) for p in photos.paths], EVAL)
    assert torch.equal(torch.cat([b[0] for b in batches]), want)


def test_a_dataset_of_another_shape_is_not_a_folder_and_says_why(photos):
    assert plan_for(photos)[0] is None and "folder dataset" in plan_for(photos)[1]
    folder = Folder(photos.paths)
    folder.loader, folder.transform = (lambda p: p), None
    plan, why = plan_for(folder)
    assert plan is None and "torchvision's PIL loader" in why


def test_offered_on_cuda_for_a_folder_whose_transform_it_reads(cpu_env):
    knob = get_knob("device_decode")
    data = describe([(torch.zeros(3, 8, 8), 0)] * 4)
    on_cpu = knob.offer(SpaceContext(cpu_env, data, 8, device_decode=EVAL.describe()))
    assert on_cpu.values == [False] and "CUDA" in on_cpu.excluded["true"]
    cuda = dataclasses.replace(cpu_env, device="cuda:0")  # the knob reads only the device
    refused = knob.offer(SpaceContext(cuda, data, 8, device_decode_why="its transform is not one of torchvision's"))
    assert refused.values == [False] and "torchvision's" in refused.excluded["true"]
    found = knob.offer(SpaceContext(cuda, data, 8, device_decode=EVAL.describe()))
    assert found.values == [False, True] or "torchvision" in found.excluded["true"]  # True where torchvision imports


def test_a_user_loader_of_a_device_decode_config_needs_a_cuda_device(photos):
    with pytest.raises(autotune.InputError, match="needs a CUDA device"):
        autotune.dataloader(photos, {"batch_size": 4, "device_decode": True}, device="cpu")


# --- on a GPU, with torchvision: nvJPEG on a real ImageFolder ----------------------------------


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """A torchvision ImageFolder of real photos in two classes, one of them a PNG, with the
    evaluation transform torchvision's recipes use."""
    from autotune.knobs.device_decode import torchvision_decode_problem

    problem = torchvision_decode_problem()
    if problem is not None:
        pytest.skip(problem)
    from PIL import Image
    from torchvision import datasets, transforms

    root = tmp_path_factory.mktemp("folder")
    paths = make_photos(tmp_path_factory.mktemp("raw"), 6)
    for i, path in enumerate(paths):
        (root / f"class_{i % 2}").mkdir(exist_ok=True)
        image = Image.open(path)
        image.save(root / f"class_{i % 2}" / (f"{i}.png" if i == 5 else f"{i}.jpg"), quality=90)
    transform = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                                    transforms.Normalize(MEAN.tolist(), STD.tolist())])  # fmt: skip
    return datasets.ImageFolder(str(root), transform=transform)


@pytest.mark.gpu
def test_nvjpeg_batches_on_the_gpu_match_the_folders_own_within_pixels(image_folder):
    """The ImageFolder's transform read as a plan; nvJPEG's batches (a PNG among them decoded on
    the host) are on the GPU, in the folder's order, with its targets, and close to its own."""
    plan, why = plan_for(image_folder)
    assert plan == dataclasses.replace(EVAL, interpolation="bilinear"), why
    loader = autotune.dataloader(image_folder, {"batch_size": 4, "device_decode": True}, device="cuda")
    batches = list(loader)
    assert all(x.device.type == "cuda" and x.dtype == torch.float32 and y.device.type == "cuda" for x, y in batches)
    got = torch.cat([x for x, _ in batches]).cpu()
    want = torch.stack([image_folder[i][0] for i in range(len(image_folder))])
    assert torch.cat([y for _, y in batches]).tolist() == [t for _, t in image_folder.samples]
    levels = (got - want).abs() * torch.tensor(STD).view(1, 3, 1, 1) * 255
    assert got.shape == want.shape and float(levels.mean()) < 3.0  # nvJPEG's IDCT and the tensor resize


@pytest.mark.gpu
def test_a_search_on_the_gpu_measures_device_decoding_and_its_claim_says_so(image_folder, tmp_path):
    result = autotune.optimize(
        LightCNN().eval(), image_folder, space={"base": None, "device_decode": [False, True]},
        fix={"device_decode": True}, baseline_batch_size=2, n_trials=2, out_dir=tmp_path, export=(), device="cuda",
        measure={"n_windows": 2, "window_s": 0.1, "warmup_batches": 1},
    )  # fmt: skip
    decoded = [t.user_attrs for t in result.study.trials if t.user_attrs.get("config", {}).get("device_decode")]
    assert decoded and decoded[0]["status"] == "ok" and decoded[0]["metric_drop"] > 0, decoded
    if result.best_config["device_decode"]:
        assert "decoded on the GPU" in result.claim
