"""Photographs as JPEG files, decoded with PIL in ``__getitem__``: the most common vision input
pipeline, one pass over new images (a deployed classifier) and repeated passes.

    python -m benchmarks.vision.photos [--n-files 240] [--trials 12] [--out DIR] [--models light,resnet50]

The folder (:func:`make_photos`): crops of scikit-learn's two sample photographs (a temple in
China, a flower), each scaled to 1-2 megapixels in several aspect ratios, flipped or not, saved as
JPEG at quality 90. :class:`PhotoFolder` opens each file with PIL and applies the standard
evaluation transform (shorter side 256, centre crop 224, float, normalised), written with PIL and
NumPy as torchvision's ``Resize(256)`` + ``CenterCrop(224)`` + ``ToTensor`` + ``Normalize`` do.

Rows, timed side by side in one process over whole passes, rotating:

- baseline: ``DataLoader(folder, batch_size=32)``, float32, no workers;
- expert: workers as the cores allow (persistent), bf16 autocast where the CPU has bf16 units,
  channels-last, batch 32;
- autotune: ``autotune.optimize(model, folder, repeated_passes=...)``'s winner through
  ``autotune.apply`` + ``autotune.dataloader``.

Models: a light CNN (MobileNet-shaped: depthwise-separable blocks, 0.2 GMACs) and ResNet-50's
shape (:mod:`benchmarks.gpu.models`), random weights: the guard compares outputs. Nothing is
asserted; the table is printed and written to ``OUT/photos.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
BATCH = 32


def make_photos(folder: Path, n: int = 240, seed: int = 0, quality: int = 90) -> list[Path]:
    """``n`` JPEG files of 1-2 megapixels cut from scikit-learn's sample photographs."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    folder.mkdir(parents=True, exist_ok=True)
    sources = [Image.fromarray(a) for a in load_sample_images().images]
    rng = random.Random(seed)
    paths = []
    for i in range(n):
        path = folder / f"photo_{i:04d}.jpg"
        paths.append(path)
        if path.exists():
            continue
        src = sources[i % len(sources)]
        w, h = src.size
        cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        crop = src.crop((x, y, x + cw, y + ch))
        megapixels = rng.uniform(1.0, 2.0) * 1e6
        k = (megapixels / (cw * ch)) ** 0.5
        photo = crop.resize((int(cw * k), int(ch * k)), Image.BICUBIC)
        if rng.random() < 0.5:
            photo = photo.transpose(Image.FLIP_LEFT_RIGHT)
        photo.save(path, "JPEG", quality=quality)
    return paths


def eval_transform(image: Any) -> torch.Tensor:
    """Shorter side 256 (bilinear), centre crop 224, to float in [0, 1], normalised; (3, 224, 224)."""
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    k = 256 / min(w, h)
    image = image.resize((max(256, round(w * k)), max(256, round(h * k))), Image.BILINEAR)
    w, h = image.size
    left, top = (w - 224) // 2, (h - 224) // 2
    image = image.crop((left, top, left + 224, top + 224))
    array = (np.asarray(image, dtype=np.float32) / 255.0 - MEAN) / STD
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


class PhotoFolder(torch.utils.data.Dataset):
    """The files of ``folder``, each opened with PIL and transformed in ``__getitem__``."""

    def __init__(self, folder: Path | str) -> None:
        self.paths = sorted(Path(folder).glob("*.jpg")) + sorted(Path(folder).glob("*.png"))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.paths[i]) as image:
            return eval_transform(image), i % 10


def _separable(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_in, 3, stride=stride, padding=1, groups=c_in, bias=False), nn.BatchNorm2d(c_in),
        nn.ReLU(inplace=True), nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
    )  # fmt: skip


class LightCNN(nn.Module):
    """A MobileNet-shaped classifier: a strided stem, depthwise-separable blocks, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        widths = [(16, 32, 2), (32, 64, 2), (64, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(*[_separable(a, b, s) for a, b, s in widths])
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def resnet50() -> nn.Module:
    from benchmarks.gpu.models import resnet50 as make

    torch.manual_seed(0)
    return make(n_classes=10).eval()


def light_cnn() -> nn.Module:
    return LightCNN().eval()


def timed_pass(model: Any, loader: Any, autocast: Any = None, channels_last: bool = False) -> float:
    """Images/s over one whole pass of ``loader`` through ``model``."""
    started, n = time.perf_counter(), 0
    with torch.inference_mode():
        for x, _ in loader:
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            if autocast is not None:
                with torch.autocast("cpu", dtype=autocast):
                    model(x)
            else:
                model(x)
            n += len(x)
    return n / (time.perf_counter() - started)


def rows(name: str, cfg: dict[str, Any], out: Path, n_trials: int, repeated: bool) -> dict[str, Any]:
    import shutil

    import autotune
    from autotune.env import Env, usable_cpus

    loader_of, make, folder = torch.utils.data.DataLoader, cfg["model"], cfg["dataset"]
    env = Env.detect("cpu")
    cores = usable_cpus()
    shutil.rmtree(out / name, ignore_errors=True)
    started = time.perf_counter()
    result = autotune.optimize(make, folder, baseline_batch_size=BATCH, n_trials=n_trials,
                               repeated_passes=repeated, out_dir=out / name, export=(), profile=False)  # fmt: skip
    search_s = time.perf_counter() - started
    bf16 = torch.bfloat16 if env.bf16 else None
    expert_model = make().to(memory_format=torch.channels_last)
    pipelines = {
        "baseline": (make(), loader_of(folder, batch_size=BATCH), None, False),
        "expert": (expert_model, loader_of(folder, batch_size=BATCH, num_workers=cores, persistent_workers=True),
                   bf16, True),
        "autotune": (autotune.apply(make(), result.best_config, dataset=folder),
                     autotune.dataloader(folder, result.best_config), None, False),
    }  # fmt: skip
    for model, loader, cast, last in pipelines.values():  # warm: workers, compiled graphs
        timed_pass(model, loader, cast, last)
    rates: dict[str, list[float]] = {k: [] for k in pipelines}
    names = list(pipelines)
    for i in range(3):
        for label in names[i % 3 :] + names[: i % 3]:
            rates[label].append(timed_pass(*pipelines[label]))
    med = {k: statistics.median(v) for k, v in rates.items()}
    base_config = next((t.user_attrs["config"] for t in result.study.trials if t.user_attrs.get("baseline")), {})
    changed = {k: v for k, v in result.best_config.items() if k in base_config and base_config[k] != v}
    return {"model": name, "repeated": repeated, "images_per_s": med, "claimed": result.speedup,
            "verdict": result.verdict, "changes": changed, "search_s": search_s}  # fmt: skip


def text(docs: list[dict[str, Any]], head: str) -> str:
    lines = [head, "", "| model | passes | baseline img/s | expert | autotune | autotune/expert | claimed | winner |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in docs:
        r = d["images_per_s"]
        lines.append(f"| {d['model']} | {'repeated' if d['repeated'] else 'one'} | {r['baseline']:.1f} | "
                     f"{r['expert']:.1f} ({r['expert'] / r['baseline']:.2f}x) | {r['autotune']:.1f} "
                     f"({r['autotune'] / r['baseline']:.2f}x) | {r['autotune'] / r['expert']:.2f}x | "
                     f"{d['claimed']:.2f}x {d['verdict']} | {d['changes']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from autotune.env import cpu_info, usable_cpus
    from benchmarks.core import workload, workloads

    parser = argparse.ArgumentParser(prog="python -m benchmarks.vision.photos", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "autotune-bench-photos")
    parser.add_argument("--n-files", type=int, default=240)
    parser.add_argument("--trials", type=int, help="trials of each search (default: the workload's, 12)")
    parser.add_argument("--models", help="comma-separated workloads (default: light,resnet50)")
    parser.add_argument("--passes", default="one,repeated", help="one, repeated or both")
    args = parser.parse_args(argv)
    isa = ",".join(cpu_info().get("isa", []))
    head = f"{cpu_info().get('model')}, {usable_cpus()} CPUs ({isa}), torch {torch.__version__}, pid {os.getpid()}"
    docs = []
    known = [w.name for w in workloads(benchmark="vision.photos")]
    names = args.models.split(",") if args.models else known
    if unknown := [n for n in names if n not in known]:
        parser.error(f"No workload named {unknown[0]!r}. Known: {', '.join(known)}.")
    for name in names:
        w = workload(name)
        cfg = w.build(folder=args.out / "photos", n=args.n_files)  # the photos are written once
        for passes in args.passes.split(","):
            docs.append(rows(name, cfg, args.out, args.trials or w.trials(), passes == "repeated"))
            print(text(docs, head), flush=True)
    (args.out / "photos.md").write_text(text(docs, head))


if __name__ == "__main__":
    main()
