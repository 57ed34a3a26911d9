"""Images: the CRAFT detector with its published weights on rendered pages (:mod:`.workload`), the
benchmark of baseline, hand recipe and autotune's winner (:mod:`.bench`, ``python -m
benchmarks.vision``), and JPEG photos decoded per read (:mod:`.photos`). This file registers the
family's workloads: each is built only when a benchmark asks for it."""

from pathlib import Path
from typing import Any

from benchmarks.core import Workload, register
from benchmarks.vision import workload as vc


def pages(n: int = 32, scan: int = 1) -> dict[str, Any]:
    """CRAFT on ``n`` rendered pages (kept as ``scan``-times larger scans), word-box recall its
    metric, 12 pages for the guard."""
    return {"model": vc.craft, "dataset": vc.Pages(n, scan=scan), "metric": vc.recall, "options": {"n_val": 12}}


def _folder(folder: Path | None, n: int) -> Any:
    # photos.py is run with python -m: it is imported when a workload is built, not above.
    import tempfile

    from benchmarks.vision import photos

    folder = folder or Path(tempfile.gettempdir()) / "autotune-bench-photos" / "photos"
    photos.make_photos(folder, n)  # only the files not there yet
    return photos.PhotoFolder(folder)


def light(folder: Path | None = None, n: int = 240) -> dict[str, Any]:
    """A MobileNet-shaped CNN (a factory), random weights, on ``n`` JPEG photos written to ``folder``."""
    from benchmarks.vision.photos import light_cnn

    return {"model": light_cnn, "dataset": _folder(folder, n)}


def resnet50(folder: Path | None = None, n: int = 240) -> dict[str, Any]:
    """ResNet-50's shape with 10 classes (a factory), random weights, on the same photos."""
    from benchmarks.vision.photos import resnet50

    return {"model": resnet50, "dataset": _folder(folder, n)}


_PHOTOS = {"n_trials": {"inference": 12}, "benchmarks": ("vision.photos",), "extras": {"unit": "images/s"}}

for _fields in (
    dict(name="craft", description="CRAFT with its published weights on 32 rendered document pages",
         build=pages, n_trials={"inference": 16}, measure={"n_windows": 3, "warmup_batches": 2},
         benchmarks=("vision",), extras={"unit": "pages/s"}),
    dict(name="light", description="a MobileNet-shaped CNN, random weights, on 240 JPEG photos decoded per read",
         build=light, **_PHOTOS),
    dict(name="resnet50", description="ResNet-50's shape, random weights, on 240 JPEG photos decoded per read",
         build=resnet50, **_PHOTOS),
):  # fmt: skip
    register(Workload(family="vision", **_fields))
