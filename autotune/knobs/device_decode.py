"""``device_decode``: image files decoded on the GPU (nvJPEG) and their transform run there.

A folder dataset in torchvision's shape (``ImageFolder`` or ``DatasetFolder``: ``samples`` of
``(path, target)``, torchvision's PIL ``loader``, a ``transform``) decodes and transforms each
photo on the host, in ``__getitem__``. Where the transform is one the tool can read (resize,
centre crop, the conversion to a tensor, normalisation: :func:`plan_for`), this lever reads
the files' bytes instead, batches them as they are, and on the device decodes the batch with
``torchvision.io.decode_jpeg(..., device="cuda")`` and applies the same transform there: the
host only reads files, and compressed bytes cross the bus, not float pixels. A file that is no
JPEG (a PNG among the photos) is decoded on the host by ``torchvision.io.decode_image`` and
transformed on the device like the rest.

The guard judges the outputs as for any lever: the tensor resize (bilinear or bicubic with
antialiasing, rounded to 8 bits as PIL's is) is close to PIL's, not equal to it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

__all__ = [
    "DecodePlan",
    "DeviceDecode",
    "DeviceDecoded",
    "EncodedFolder",
    "encoded_collate",
    "plan_for",
    "plan_from_steps",
    "transform_images",
]

_LOADERS = ("default_loader", "pil_loader")  # torchvision.datasets.folder's PIL loaders
_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
_JPEG_MAGIC = (0xFF, 0xD8)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A folder dataset's transform as the device runs it: a resize (a ``shorter`` side, or a
    fixed ``size`` (height, width)), a centre ``crop`` (height, width), 8-bit values to floats
    in [0, 1] (``scale``), and a normalisation (``mean``, ``std``)."""

    shorter: int | None = None
    size: tuple[int, int] | None = None
    interpolation: str = "bilinear"
    crop: tuple[int, int] | None = None
    scale: bool = True
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def describe(self) -> str:
        parts = []
        if self.shorter is not None:
            parts.append(f"resize shorter side {self.shorter}")
        elif self.size is not None:
            parts.append(f"resize {self.size[0]}x{self.size[1]}")
        if self.crop is not None:
            parts.append(f"centre crop {self.crop[0]}x{self.crop[1]}")
        parts.append("to float" if self.scale else "uint8")
        if self.mean is not None:
            parts.append("normalise")
        return ", ".join(parts)


def _pair(size: Any) -> tuple[int, int] | None:
    if isinstance(size, int):
        return (size, size)
    if isinstance(size, (list, tuple)) and len(size) == 1 and isinstance(size[0], int):
        return (size[0], size[0])
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) for s in size):
        return (int(size[0]), int(size[1]))
    return None


def plan_from_steps(steps: Sequence[tuple[str, dict[str, Any]]]) -> tuple[DecodePlan | None, str]:
    """The plan of a transform given as its steps, each ``(class name, attributes)`` of a
    torchvision transform, in order; ``(None, why)`` where a step is not one the device can run
    or the steps are in another order (geometry on the image, then the conversion to a tensor,
    then the normalisation).

    Example:
        >>> plan, _ = plan_from_steps([("Resize", {"size": 256}), ("CenterCrop", {"size": 224}),
        ...                            ("ToTensor", {}), ("Normalize", {"mean": [0.5] * 3, "std": [0.5] * 3})])
        >>> plan.describe()
        'resize shorter side 256, centre crop 224x224, to float, normalise'
    """
    fields: dict[str, Any] = {}
    converted = False
    for name, attrs in steps:
        resized = "shorter" in fields or "size" in fields
        if name == "Resize" and not converted and "crop" not in fields and not resized:
            size, mode = attrs.get("size"), str(attrs.get("interpolation", "bilinear")).lower()
            mode = mode.rsplit(".", 1)[-1]
            if attrs.get("max_size") is not None or attrs.get("antialias") is False or mode not in _INTERPOLATIONS:
                return None, f"a Resize with max_size, antialias=False or {mode} interpolation"
            if isinstance(size, int) or (isinstance(size, (list, tuple)) and len(size) == 1):
                fields["shorter"] = int(size if isinstance(size, int) else size[0])
            elif _pair(size) is not None:
                fields["size"] = _pair(size)
            else:
                return None, f"a Resize to {size!r}"
            fields["interpolation"] = mode
        elif name == "CenterCrop" and not converted and "crop" not in fields and _pair(attrs.get("size")):
            fields["crop"] = _pair(attrs.get("size"))
        elif name in ("ToTensor", "PILToTensor", "ToImage") and not converted:
            converted, fields["scale"] = True, name == "ToTensor"
        elif name in ("ToDtype", "ConvertImageDtype") and converted:
            dtype = attrs.get("dtype")
            dtype = dtype.get(torch.Tensor, dtype) if isinstance(dtype, dict) else dtype
            if dtype is not torch.float32 or (name == "ToDtype" and not attrs.get("scale", False)):
                return None, f"a {name} to {dtype} without scaling to [0, 1]"
            fields["scale"] = True
        elif name == "Normalize" and converted and fields.get("scale") and "mean" not in fields:
            fields["mean"], fields["std"] = tuple(map(float, attrs["mean"])), tuple(map(float, attrs["std"]))
        else:
            return None, f"a {name} step (the device runs Resize, CenterCrop, ToTensor and Normalize, in that order)"
    if not converted:
        return None, "no conversion to a tensor (ToTensor, PILToTensor or ToImage)"
    if "crop" not in fields and "size" not in fields:
        return None, "images of different sizes: no centre crop or fixed resize makes them one size to batch"
    return DecodePlan(**fields), ""


def _steps(transform: Any) -> list[tuple[str, dict[str, Any]]] | None:
    """A torchvision transform as :func:`plan_from_steps` reads it, or ``None`` for another kind."""
    inner = transform.transforms if type(transform).__name__ == "Compose" else [transform]
    steps = []
    for step in inner:
        cls = type(step)
        if not cls.__module__.startswith("torchvision.transforms"):
            return None
        attrs = {k: getattr(step, k) for k in ("size", "interpolation", "max_size", "antialias", "mean", "std",
                                                "dtype", "scale") if hasattr(step, k)}  # fmt: skip
        if "interpolation" in attrs:
            attrs["interpolation"] = getattr(attrs["interpolation"], "value", attrs["interpolation"])
        steps.append((cls.__name__, attrs))
    return steps


def plan_for(dataset: Any) -> tuple[DecodePlan | None, str]:
    """The :class:`DecodePlan` of a torchvision folder dataset, or ``(None, why)``: not a folder
    dataset of files read by torchvision's PIL loader, or a transform the device cannot run."""
    samples, loader = getattr(dataset, "samples", None), getattr(dataset, "loader", None)
    if not isinstance(samples, list) or not samples or not callable(loader):
        return None, "not a folder dataset (torchvision's ImageFolder or DatasetFolder: samples, loader, transform)"
    if getattr(loader, "__name__", "") not in _LOADERS or not str(getattr(loader, "__module__", "")).startswith(
        "torchvision"
    ):
        return None, "its loader is not torchvision's PIL loader"
    first = samples[0]
    if not (isinstance(first, tuple) and len(first) == 2 and isinstance(first[0], (str, Path))):
        return None, "its samples are not (path, target) pairs"
    transform = getattr(dataset, "transform", None)
    steps = None if transform is None else _steps(transform)
    if steps is None:
        return None, "its transform is not one of torchvision's"
    return plan_from_steps(steps)


class EncodedFolder(torch.utils.data.Dataset):
    """A folder dataset's samples as ``(file bytes as a uint8 tensor, target)``: the files read,
    nothing decoded. The target goes through the dataset's ``target_transform``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.samples = list(dataset.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        path, target = self.samples[index]
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
        target_transform = getattr(self.dataset, "target_transform", None)
        return data, target if target_transform is None else target_transform(target)


def encoded_collate(samples: list[tuple[torch.Tensor, Any]]) -> tuple[list[torch.Tensor], Any]:
    """A batch of :class:`EncodedFolder` samples: the files' bytes as a list (each its own
    length), the targets collated as ``default_collate`` does."""
    from torch.utils.data import default_collate

    return [s[0] for s in samples], default_collate([s[1] for s in samples])


def _resize(images: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """uint8 ``(N, C, H, W)`` resized to ``size`` with antialiasing, rounded back to 8 bits
    (PIL's resize returns 8-bit pixels, and the user's ToTensor reads those)."""
    if tuple(images.shape[-2:]) == size:
        return images
    kwargs = {} if mode == "nearest" else {"antialias": True, "align_corners": False}
    out = torch.nn.functional.interpolate(images.float(), size=size, mode=mode, **kwargs)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _target_size(height: int, width: int, plan: DecodePlan) -> tuple[int, int]:
    if plan.size is not None:
        return plan.size
    if plan.shorter is None:
        return (height, width)
    # torchvision's Resize(int): the shorter side to ``shorter``, the longer scaled and truncated.
    if height <= width:
        return (plan.shorter, int(plan.shorter * width / height))
    return (int(plan.shorter * height / width), plan.shorter)


def transform_images(images: Sequence[torch.Tensor], plan: DecodePlan) -> torch.Tensor:
    """Decoded uint8 ``(3, H, W)`` images, each its own size, transformed by ``plan`` on their
    device and stacked: ``(N, 3, crop height, crop width)``, float32 where the plan scales.
    Images of one size are resized together."""
    out: list[torch.Tensor | None] = [None] * len(images)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        groups.setdefault(tuple(image.shape[-2:]), []).append(i)
    for (h, w), members in groups.items():
        batch = _resize(torch.stack([images[i] for i in members]), _target_size(h, w, plan), plan.interpolation)
        if plan.crop is not None:
            ch, cw = plan.crop
            top, left = round((batch.shape[-2] - ch) / 2.0), round((batch.shape[-1] - cw) / 2.0)
            batch = batch[..., top : top + ch, left : left + cw]
        for j, i in enumerate(members):
            out[i] = batch[j]
    stacked = torch.stack(out)  # type: ignore[arg-type]
    if not plan.scale:
        return stacked.contiguous()
    stacked = stacked.float().div_(255.0)
    if plan.mean is not None:
        mean = torch.tensor(plan.mean, device=stacked.device).view(1, -1, 1, 1)
        std = torch.tensor(plan.std, device=stacked.device).view(1, -1, 1, 1)
        stacked = stacked.sub_(mean).div_(std)
    return stacked


def is_jpeg(data: torch.Tensor) -> bool:
    return data.numel() > 2 and (int(data[0]), int(data[1])) == _JPEG_MAGIC


def nvjpeg_decoder(device: str) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """Files' bytes to uint8 RGB ``(3, H, W)`` images on ``device``: JPEGs by nvJPEG
    (``torchvision.io.decode_jpeg`` on the device, a batch at a time), any other format by
    ``torchvision.io.decode_image`` on the host, then copied."""
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    def decode(files: list[torch.Tensor]) -> list[torch.Tensor]:
        jpegs = [i for i, f in enumerate(files) if is_jpeg(f)]
        out: list[torch.Tensor | None] = [None] * len(files)
        if jpegs:
            decoded = decode_jpeg([files[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
            for i, image in zip(jpegs, decoded, strict=True):
                out[i] = image
        for i, f in enumerate(files):
            if out[i] is None:
                out[i] = decode_image(f, mode=ImageReadMode.RGB).to(device, non_blocking=True)
        return out  # type: ignore[return-value]

    return decode


class DeviceDecoded:
    """``loader``'s batches of :func:`encoded_collate` as the folder dataset's own batches:
    ``(images, targets)`` on the device, each batch's files decoded by ``decoder`` and
    transformed by ``plan`` there. It has the loader's length and attributes.

    Args:
        loader: A DataLoader over an :class:`EncodedFolder` with :func:`encoded_collate`.
        plan: The transform to run on the device.
        device: Where the batches go.
        decoder: Files' bytes to uint8 ``(3, H, W)`` images on ``device`` (default: nvJPEG's,
            :func:`nvjpeg_decoder`).
    """

    def __init__(self, loader: Any, plan: DecodePlan, device: str, decoder: Callable[..., Any] | None = None):
        self.loader, self.plan, self.device = loader, plan, str(device)
        self.decoder = decoder or nvjpeg_decoder(self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, Any]]:
        from autotune.samples import to_device

        for files, targets in self.loader:
            images = transform_images(self.decoder(files), self.plan)
            yield images, to_device(targets, self.device)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("loader", "plan", "device", "decoder"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def torchvision_decode_problem() -> str | None:
    """Why nvJPEG decoding cannot run in this process, or ``None``."""
    if importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed (pip install torchvision, the build matching torch)"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as exc:  # a torchvision built for another torch fails here
        return f"torchvision does not import here ({type(exc).__name__}: {str(exc)[:120]})"
    return None


def device_decoded(loader: Any, dataset: Any, device: str) -> Any:
    """``loader`` (over :class:`EncodedFolder` of ``dataset``) as :class:`DeviceDecoded` batches."""
    plan, why = plan_for(dataset)
    if plan is None:
        from autotune.errors import TrialError

        raise TrialError("unsupported", f"device_decode: {why}")
    return DeviceDecoded(loader, plan, device)


@register
class DeviceDecode(Knob):
    name = "device_decode"
    side = "loader"
    claim_note = (
        "decoded_on_device",
        "image files decoded on the GPU (nvJPEG) and transformed there, as the dataset's transform does",
        "images decoded on the GPU",
    )
    # One pass over photos read by ImageFolder: the host decodes and resizes each in tens of ms,
    # nvJPEG decodes a batch on the device; screened with the first tier on CUDA.
    reads_samples = True
    screen = (True,)
    screen_rank = 31
    first_tier = True
    order = 28
    stage = Stage.LOADER
    choices = (False, True)
    default = False
    help = (
        "Decode the image files of a torchvision folder dataset (ImageFolder, DatasetFolder) on the GPU with "
        "nvJPEG and run its transform there (resize, centre crop, to float, normalise): the host reads bytes, "
        "compressed files cross the bus. CUDA with torchvision only, for a transform the device can run."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if not ctx.env.is_cuda:
            return Offer([False], {"true": "decoding on the device needs CUDA (nvJPEG)"})
        if ctx.device_decode is None:
            return Offer([False], {"true": ctx.device_decode_why or "the dataset is no torchvision folder dataset"})
        problem = torchvision_decode_problem()
        if problem is not None:
            return Offer([False], {"true": problem})
        return Offer([False, True])

    def apply(self, state: Any, value: bool) -> None:
        state.device_decode = value
