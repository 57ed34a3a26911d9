"""What a run says about the search space it was given, beside its result.

The ``default`` preset tunes the model's pipeline, in PyTorch and, for inference on a CPU where
it is installed, in OpenVINO (its int8 included): no TorchScript, no ONNX Runtime, no PyTorch
int8. On a CPU without OpenVINO those are often where the largest gains are (an int8 ONNX
Runtime winner on a CPU server, say), so a CPU run of that preset says which preset searches them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["space_note"]


def space_note(opts: Any) -> str | None:
    """The note for a CPU inference run of the ``default`` preset that leaves PyTorch's int8 and
    the TorchScript and ONNX Runtime runtimes out, else ``None``.

    Args:
        opts: The run's :class:`~autotune.run.options.Options`.

    Example:
        >>> from autotune.run.options import Options
        >>> space_note(Options(device="cpu")).split(":")[0]
        'The default space searched no ONNX Runtime, no TorchScript and no PyTorch int8'
        >>> space_note(Options(device="cpu", space="cpu-deploy")) is None
        True
    """
    from autotune.knobs import declared

    if opts.train or not _on_cpu(opts):
        return None
    space = opts.space
    if isinstance(space, Mapping):
        named = {k for k in space if k != "base"}
        space = space.get("base", "default")
    else:
        named = set()
    named |= set(opts.fix or {})
    if not isinstance(space, str) or space != "default" or named & set(declared("deploy")):
        return None
    return (
        "The default space searched no ONNX Runtime, no TorchScript and no PyTorch int8: on a CPU, the "
        'cpu-deploy preset adds them, with ONNX Runtime\'s int8 (space="cpu-deploy", CLI: --space cpu-deploy).'
    )


def _on_cpu(opts: Any) -> bool:
    devices = opts.devices
    if devices is not None:
        items = devices.split(",") if isinstance(devices, str) else list(devices)
        return all(str(d).strip().lower() == "cpu" for d in items)
    from autotune.env import resolve_device

    return resolve_device(opts.device) == "cpu"
