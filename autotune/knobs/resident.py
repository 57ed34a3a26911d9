"""``device_resident``: a dataset that fits kept on the device, each batch gathered there.

What a GPU engineer does with a dataset that fits the card: copy it there once and slice batches
on the device, so no batch crosses the bus or waits for the host. ResNet-50 fed 1,024 in-memory
224x224 images on an H100 ran at about a third of its model alone through per-batch host
gathers, pins and copies; with the images on the device a batch is one device-side copy.

The lever copies the samples' tensors (the rows of a ``TensorDataset`` or of the tensors
``__getitem__`` slices, a list of equal-shape samples, or a dataset's decoded samples, read once
and stacked) to the device when they fit :data:`DEVICE_SHARE` of its free memory. Each batch is
then a slice of them (consecutive indices, as an inference pass reads) or an index on the device
(shuffled, as training reads): the same batches ``__getitem__`` and ``default_collate`` make, on
the device. Loader workers and pinning have nothing left to do: the loader reads in the calling
process. It pays where the same samples are read again (epochs, repeated inference over a fixed
set), like ``cache_decoded``, and the claim says it assumes so.

A dataset whose tensors are on the device already is read the same way, by ``gather``.
"""

from __future__ import annotations

from typing import Any

from autotune.errors import TrialError
from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

__all__ = ["DEVICE_SHARE", "DeviceResident", "fits", "host_free_kwargs", "on_device", "resident"]

# The share of the device's free memory the resident samples may take (the rest is the model's).
DEVICE_SHARE = 0.5


def free_bytes(device: Any) -> int:
    """Free memory of ``device``: the CUDA device's free memory now, or on the CPU the machine's
    memory (the copy then stays in host memory, where the samples are already)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    from autotune.env import host_memory_bytes

    return host_memory_bytes()


def fits(need: int, free: int) -> str | None:
    """Why ``need`` bytes do not fit :data:`DEVICE_SHARE` of ``free``, or ``None`` when they do.

    Example:
        >>> fits(2**30, 4 * 2**30) is None, fits(3 * 2**30, 4 * 2**30)
        (True, 'the samples take 3.00 GiB, more than 50% of the device's 4.00 GiB free')
    """
    if need <= DEVICE_SHARE * free:
        return None
    return (
        f"the samples take {need / 2**30:.2f} GiB, more than {DEVICE_SHARE:.0%} of the device's "
        f"{free / 2**30:.2f} GiB free"
    )


def resident(dataset: Any, device: Any, *, free: int | None = None) -> Any:
    """``dataset``'s samples on ``device``, as a :class:`~autotune.knobs.gather.GatheredDataset`
    whose batches are gathered there (its collate is :func:`~autotune.knobs.gather.as_batch`).

    A ``TensorDataset``'s tensors and a list's samples are stacked as they are; any other
    dataset's samples are read once (decoded) and stacked, where they share one structure, shape
    and dtype.

    Raises:
        TrialError: kind ``unsupported``: the samples cannot be stacked, or do not fit
            :data:`DEVICE_SHARE` of ``free`` (default: the device's free memory now).
    """
    import torch

    from autotune.knobs.gather import GatheredDataset, gathered

    free = free_bytes(device) if free is None else free
    if isinstance(dataset, (list, tuple, torch.utils.data.TensorDataset)):
        found = gathered(dataset)
    else:  # decoded in __getitem__, say: read every sample once, then stack them
        found = gathered([dataset[i] for i in range(len(dataset))])
    if found is None:
        raise TrialError(
            "unsupported",
            "device_resident: the samples are not tensors of one structure, shape and dtype, so they "
            "cannot be stacked on the device",
        )
    why = fits(sum(f.numel() * f.element_size() for f in found.fields), free)
    if why is not None:
        raise TrialError("unsupported", f"device_resident: {why}")
    fields = [f.to(device) for f in found.fields]
    return GatheredDataset(dataset, fields, found.proto)


def on_device(dataset: Any) -> bool:
    """Whether ``dataset`` is a gathered dataset whose tensors are not in host memory."""
    fields = getattr(dataset, "fields", None)
    return bool(fields) and all(getattr(f, "device", None) is not None and f.device.type != "cpu" for f in fields)


def host_free_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """DataLoader keyword arguments for data read on the device: in the calling process (no
    workers, which cannot share a CUDA context), nothing pinned.

    Example:
        >>> host_free_kwargs({"batch_size": 8, "num_workers": 4, "pin_memory": True, "prefetch_factor": 4})
        {'batch_size': 8, 'num_workers': 0, 'pin_memory': False}
    """
    dropped = ("prefetch_factor", "persistent_workers", "pin_memory_device")
    kept = {k: v for k, v in kwargs.items() if k not in dropped}
    return {**kept, "num_workers": 0, "pin_memory": False}


@register
class DeviceResident(Knob):
    name = "device_resident"
    pays_on_repeats = "samples kept on the device"
    side = "loader"
    # Before the loader's knobs: with the data on the device, workers, pinning, gather and the
    # decoded-sample cache do not apply.
    order = 19
    stage = Stage.LOADER
    choices = (False, True)
    default = False
    help = (
        "Copy the dataset's samples to the GPU once (tensors, equal-shape samples, or decoded samples read once "
        "and stacked) when they fit half its free memory, and gather each batch there: nothing crosses the bus "
        "per batch. Offered on CUDA where the same samples are read again (training, or repeated_passes=True) "
        "and default_collate makes the batches."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if not ctx.env.is_cuda:
            return Offer([False], {"true": "keeps the samples on a CUDA device; on the CPU they are in its memory"})
        if not ctx.repeated_passes:
            why = "pays only when the same samples are read again: pass repeated_passes=True if they are"
            return Offer([False], {"true": why})
        data = ctx.data
        if data.collate != "default":
            return Offer([False], {"true": "a collate makes the batches: they are not slices of stacked samples"})
        why = fits(data.sample_bytes * data.n_samples, ctx.env.device_mem_bytes)
        if why is not None:
            return Offer([False], {"true": why.replace(" free", "")})
        return Offer([False, True])

    def apply(self, state: Any, value: bool) -> None:
        state.device_resident = value
