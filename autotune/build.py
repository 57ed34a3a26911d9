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
from .data import batch_size_of, map_tensors, model_inputs, to_device
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


class FrozenCompiled(torch.nn.Module):
    """A compiled module whose calls run with inductor's weight freezing on, so that a statically
    quantized graph compiles to int8 kernels, without turning freezing on for anything else."""

    def __init__(self, compiled: torch.nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch._inductor.config as inductor_config

        with inductor_config.patch(freezing=True):
            return self.compiled(*args, **kwargs)


def unwrap(model: Any) -> Any:
    """The user's (tuned) module under the compile, freezing and autocast wrappers."""
    if isinstance(model, FrozenCompiled):
        model = model.compiled
    model = getattr(model, "_orig_mod", model)
    return model.model if isinstance(model, TunedModule) else model


def _to_float32(out: Any) -> Any:
    return map_tensors(lambda t: t.float() if t.is_floating_point() else t, out)


@dataclasses.dataclass
class BuildExtras:
    """Data some knobs need besides the model: example inputs to trace (pruning, export),
    calibration batches (static quantization), and what recovery fine-tuning trains with.

    Attributes:
        example: One collated batch on the CPU.
        calibration: Collated batches on the CPU.
        loss_fn: ``loss_fn(outputs, batch) -> Tensor`` or ``None``.
        train_dataset: Samples for fine-tuning.
        batch_size: Fine-tuning batch size.
        prune_ignore: Module names pruning keeps whole (the output layer always is).
        seed: Seeds fine-tuning's shuffling.
        keep_float: Keep a copy of the pruned float model (for export fallbacks).
    """

    example: Any = None
    calibration: list[Any] = dataclasses.field(default_factory=list)
    loss_fn: Any = None
    train_dataset: Any = None
    batch_size: int = 32
    prune_ignore: tuple[str, ...] = ()
    seed: int = 0
    keep_float: bool = False

    def example_on(self, device: str) -> Any:
        """The example batch on ``device``."""
        return to_device(self.example, torch.device(device))


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
        extras: Example, calibration and fine-tuning data (see :class:`BuildExtras`).
        prune_ratio: Set by the ``prune_ratio`` knob for ``prune_method`` to act on.
        quantization: The quantization method applied.
        info: What the build did: params and MACs before and after pruning, quantization details.
        config: The whole configuration, for knobs whose work depends on others' values.
        runtime: ``torch``, ``torchscript`` or ``onnxruntime``: what runs the model.
        float_model: With ``extras.keep_float``, a copy of the model after pruning and before
            quantization: the nearest form an exporter can take when the tuned one fails.
        torch_model: The torch module a non-torch runtime (TorchScript, ONNX Runtime) replaced.
        artifact: The file a non-torch runtime runs, as measured: ``{"format", "path",
            "input_names", ...}`` (ONNX: ``output_names``, ``ort`` session settings, ``precision``).
        optimizer_impl: Training mode: ``default``, ``foreach`` or ``fused`` optimizer step.
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
    extras: BuildExtras | None = None
    prune_ratio: float = 0.0
    quantization: str = "none"
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    config: Config | None = None
    runtime: str = "torch"
    float_model: Any = None
    torch_model: Any = None
    artifact: dict[str, Any] | None = None
    optimizer_impl: str = "default"


def build(
    model: Any, config: Config, device: str, *, extras: BuildExtras | None = None, copy_model: bool = True
) -> BuildState:
    """Apply every knob of ``config`` to a copy of ``model``, in stage order.

    With ``extras.example``, the model's parameters and MACs after the STRUCTURE stage are
    recorded in ``state.info`` (``n_params``, ``macs``).

    Example:
        >>> import torch
        >>> state = build(torch.nn.Linear(4, 2), Config({"batch_size": 8}), "cpu")
        >>> state.loader_kwargs["batch_size"]
        8
    """
    model = copy.deepcopy(model) if copy_model else model
    model = model.to(device).eval()
    state = BuildState(model=model, device=device, extras=extras, config=config)
    knobs = sorted(REGISTRY.values(), key=lambda k: k.stage)
    stage = Stage.STRUCTURE
    for knob in knobs:
        if stage == Stage.STRUCTURE and knob.stage > Stage.STRUCTURE:
            _count_(state)
        if stage < Stage.COMPILE <= knob.stage:
            state.model = TunedModule(state.model, state.amp_dtype, state.channels_last).eval()
        stage = knob.stage
        knob.apply(state, config[knob.name])
    return state


def _count_(state: BuildState) -> None:
    state.info["n_params"] = sum(p.numel() for p in state.model.parameters())
    if state.extras is not None and state.extras.keep_float:
        state.float_model = copy.deepcopy(state.model)
    if state.extras is not None and state.extras.example is not None:
        from ._prune import count_macs

        example = state.extras.example_on(state.device)
        args, kwargs = model_inputs(example)
        try:
            state.info["macs"] = count_macs(state.model, args, kwargs)[0] // batch_size_of(example)
        except Exception:  # a counter that cannot trace the model must not fail the trial
            state.info["macs"] = None


def make_loader(dataset: Any, state: BuildState, *, drop_last: bool = False) -> Any:
    """The DataLoader a built configuration reads from (in dataset order)."""
    kwargs = dict(state.loader_kwargs)
    return torch.utils.data.DataLoader(dataset, shuffle=False, drop_last=drop_last, **kwargs)


def apply_settings(settings: dict[str, Any]) -> None:
    """Set the process-wide settings a configuration chose, on top of PyTorch's defaults.

    ``tf32=False`` leaves PyTorch's defaults alone (float32 matmuls in full precision, cuDNN
    convolutions allowed TF32, as stock PyTorch has them): the baseline is never slower than
    stock PyTorch. ``tf32=True`` turns TF32 on for matmuls and convolutions.
    """
    if settings.get("num_threads"):
        torch.set_num_threads(settings["num_threads"])
    if "cudnn_benchmark" in settings:
        torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
    if settings.get("tf32"):
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


@contextlib.contextmanager
def settings_active(settings: dict[str, Any]) -> Iterator[None]:
    """Activate process-wide settings for the duration of the block, then restore every
    process-wide setting (see :mod:`autotune._pristine`) as it was before the block."""
    from ._pristine import restore, snapshot

    saved = snapshot()
    try:
        apply_settings(settings)
        yield
    finally:
        restore(saved)
