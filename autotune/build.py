"""Turn (model, Config) into what runs: knobs applied in stage order.

The result is a :class:`BuildState` holding the tuned module (wrapped for autocast and
channels-last inputs, then compiled), the DataLoader keyword arguments and the process-wide
settings to activate while the model runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from .config import Config
from .data import map_tensors
from .knobs import REGISTRY, Stage

__all__ = ["BuildState", "TunedModule", "apply_settings", "build", "make_loader", "settings_active"]


class TunedModule(torch.nn.Module):
    """The user's model behind autocast and channels-last inputs; outputs stay float32.

    Args:
        model: The (possibly pruned or quantized) model.
        amp_dtype: ``"bfloat16"``, ``"float16"`` or ``None`` for no autocast.
        channels_last: Convert 4-D floating inputs to channels-last memory format.
    """

    def __init__(self, model: torch.nn.Module, amp_dtype: str | None, channels_last: bool) -> None:
        super().__init__()
        self.model = model
        self.amp_dtype = amp_dtype
        self.channels_last = channels_last

    def _prepare(self, value: Any) -> Any:
        if self.channels_last and isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
            return value.contiguous(memory_format=torch.channels_last)
        return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(self._prepare(a) for a in args)
        kwargs = {k: self._prepare(v) for k, v in kwargs.items()}
        if self.amp_dtype is None:
            return self.model(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device_type = tensors[0].device.type if tensors else "cpu"
        with torch.autocast(device_type, dtype=getattr(torch, self.amp_dtype)):
            out = self.model(*args, **kwargs)
        # Callers get float32, as from the untuned model: a drop-in replacement.
        return _to_float32(out)


def _to_float32(out: Any) -> Any:
    return map_tensors(lambda t: t.float() if t.is_floating_point() else t, out)


@dataclasses.dataclass
class BuildState:
    """What the knobs change, stage by stage.

    Attributes:
        model: The module being built; after the build, the thing to call.
        device: Where it runs.
        batch_size: Samples per batch.
        amp_dtype: Autocast dtype name or ``None``.
        channels_last: Whether 4-D inputs and weights are channels-last.
        compile_mode: ``torch.compile`` mode or ``"none"``.
        loader_kwargs: Keyword arguments of the DataLoader.
        non_blocking: Copy batches to the device asynchronously (with pinned memory).
        settings: Process-wide settings (``num_threads``, ``cudnn_benchmark``, ``tf32``).
    """

    model: Any
    device: str
    batch_size: int = 32
    amp_dtype: str | None = None
    channels_last: bool = False
    compile_mode: str = "none"
    loader_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    non_blocking: bool = False
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


def build(model: Any, config: Config, device: str, *, copy_model: bool = True) -> BuildState:
    """Apply every knob of ``config`` to a copy of ``model``, in stage order.

    Example:
        >>> import torch
        >>> state = build(torch.nn.Linear(4, 2), Config({"batch_size": 8}), "cpu")
        >>> state.loader_kwargs["batch_size"]
        8
    """
    model = copy.deepcopy(model) if copy_model else model
    model = model.to(device).eval()
    state = BuildState(model=model, device=device)
    knobs = sorted(REGISTRY.values(), key=lambda k: k.stage)
    wrapped = False
    for knob in knobs:
        if knob.stage >= Stage.COMPILE and not wrapped:
            state.model = TunedModule(state.model, state.amp_dtype, state.channels_last).eval()
            wrapped = True
        knob.apply(state, config[knob.name])
    return state


def make_loader(dataset: Any, state: BuildState, *, drop_last: bool = False) -> Any:
    """The DataLoader a built configuration reads from (in dataset order)."""
    kwargs = dict(state.loader_kwargs)
    return torch.utils.data.DataLoader(dataset, shuffle=False, drop_last=drop_last, **kwargs)


def apply_settings(settings: dict[str, Any]) -> None:
    """Set the process-wide settings a configuration chose."""
    if settings.get("num_threads"):
        torch.set_num_threads(settings["num_threads"])
    if "cudnn_benchmark" in settings:
        torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
    if "tf32" in settings:
        torch.set_float32_matmul_precision("high" if settings["tf32"] else "highest")
        torch.backends.cudnn.allow_tf32 = settings["tf32"]


@contextlib.contextmanager
def settings_active(settings: dict[str, Any]) -> Iterator[None]:
    """Activate process-wide settings for the duration of the block, then restore them."""
    saved = {
        "num_threads": torch.get_num_threads(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32": torch.get_float32_matmul_precision() != "highest",
    }
    saved_cudnn_tf32 = torch.backends.cudnn.allow_tf32
    try:
        apply_settings(settings)
        yield
    finally:
        apply_settings(saved)
        torch.backends.cudnn.allow_tf32 = saved_cudnn_tf32
