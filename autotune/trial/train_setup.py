"""Training mode's pieces: the optimizer (and its implementation), gradient accumulation, the
scaler, autocast and the loader of one configuration, as :func:`autotune.training` hands them to
a user's loop and as every training trial (:mod:`autotune.trial.training`) runs them.

An effective batch of ``E`` samples is ``E // batch_size`` micro-batches whose gradients are
accumulated, so a smaller micro-batch changes how the step is computed, not what it learns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from autotune.config import Config
from autotune.errors import ConfigError, InputError, TrialError
from autotune.knobs.state import unwrap
from autotune.samples import to_device
from autotune.trial.build import build
from autotune.trial.measure import call_model

__all__ = [
    "FixedOrder",
    "TrainingSetup",
    "accumulation",
    "check_effective",
    "check_training",
    "optimizer_factory",
    "optimizer_name",
    "prepare",
    "with_impl",
]


def optimizer_factory(optimizer: Any) -> Callable[[Iterable[Any]], torch.optim.Optimizer]:
    """Normalise ``optimizer`` to a function ``params -> Optimizer``.

    Args:
        optimizer: An optimizer class (its default hyper-parameters), a ``(class, kwargs)``
            pair, or a function taking the parameters and returning an optimizer.

    Raises:
        ConfigError: none of those (an optimizer instance, say: each trial needs a new one).

    Example:
        >>> make = optimizer_factory((torch.optim.SGD, {"lr": 0.1}))
        >>> make(torch.nn.Linear(2, 1).parameters()).defaults["lr"]
        0.1
    """
    fix = (
        "pass an optimizer class (torch.optim.AdamW), a pair (torch.optim.AdamW, {'lr': 1e-3}) "
        "or a function params -> optimizer"
    )
    if optimizer is None:
        raise ConfigError(f"Training mode needs `optimizer`: {fix}.")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"`optimizer` is an optimizer instance, but every trial starts from fresh weights with a new one: {fix}."
        )
    if isinstance(optimizer, tuple) and len(optimizer) == 2 and isinstance(optimizer[0], type):
        cls, kwargs = optimizer
        if not issubclass(cls, torch.optim.Optimizer) or not isinstance(kwargs, Mapping):
            raise ConfigError(f"`optimizer` pair must be (an Optimizer subclass, a dict of its arguments): {fix}.")
        return functools.partial(cls, **dict(kwargs))
    if isinstance(optimizer, type) and not issubclass(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"`optimizer` class {optimizer.__name__} is not a torch.optim.Optimizer: {fix}.")
    if not callable(optimizer):
        raise ConfigError(f"`optimizer` must be a class or a function, but got {type(optimizer).__name__}: {fix}.")
    return optimizer


def with_impl(optimizer: torch.optim.Optimizer, impl: str) -> torch.optim.Optimizer:
    """The same optimizer (hyper-parameters, parameter groups) with its ``foreach`` or ``fused``
    implementation; ``"default"`` returns it unchanged. Call before the first step.

    Raises:
        TrialError: kind ``unsupported`` when the optimizer or the device has no such
            implementation.
    """
    if impl == "default":
        return optimizer
    name = type(optimizer).__name__
    if impl not in optimizer.defaults:
        raise TrialError("unsupported", f"{name} has no {impl} implementation")
    flags = {"foreach": impl == "foreach"}
    if "fused" in optimizer.defaults:
        flags["fused"] = impl == "fused"
    # Rebuilt through its constructor, which validates the flags (fused needs floating
    # parameters on a supported device) and sets what the gradient scaler reads.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in {**optimizer.defaults, **flags}.items() if k in accepted}
    groups = [{**group, **flags} for group in optimizer.param_groups]
    try:
        return type(optimizer)(groups, **defaults)
    except Exception as exc:
        raise TrialError("unsupported", f"{name}({impl}=True) is not available here: {exc}") from None


@dataclasses.dataclass
class TrainingSetup:
    """The tuned pieces of a training loop.

    Attributes:
        model: The tuned module in train mode (on the device, channels-last inputs and weights,
            compiled); run its forward and the loss under :meth:`autocast`.
        optimizer: The optimizer over ``model``'s parameters, with the tuned implementation.
        scaler: A ``torch.amp.GradScaler``, enabled for float16 only (a no-op otherwise).
        loader: The DataLoader of micro-batches.
        accumulation_steps: Micro-batches per optimizer step.
        batch_size: Samples per micro-batch.
        effective_batch_size: Samples per optimizer step.
        amp_dtype: Autocast dtype name, or ``None``.
        device: Where it runs.
        non_blocking: Copy batches asynchronously (pinned memory).
        settings: Process-wide settings of the configuration (threads, cuDNN, TF32).
        channels_last: Whether inputs and weights are channels-last.
        ddp: The ``DistributedDataParallel`` wrapper of ``model`` (``model`` itself, or its
            compiled form) in a distributed run, else ``None``.
        no_sync: In a distributed run, all-reduce gradients only on a step's last micro-batch.
        sampler: The loader's sampler (a ``DistributedSampler`` in a distributed run: call its
            ``set_epoch`` at each epoch).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    loader: Any
    accumulation_steps: int
    batch_size: int
    effective_batch_size: int
    amp_dtype: str | None
    device: str
    non_blocking: bool = False
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    channels_last: bool = False
    ddp: Any = None
    no_sync: bool = True
    sampler: Any = None

    def autocast(self) -> Any:
        """The autocast context of the configuration (a no-op without mixed precision)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=getattr(torch, self.amp_dtype))

    def to_device(self, batch: Any) -> Any:
        """``batch`` on the device, copied asynchronously where memory is pinned."""
        return to_device(batch, torch.device(self.device), non_blocking=self.non_blocking)

    def step(self, batches: Iterator[Any], loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One optimizer step over ``accumulation_steps`` micro-batches drawn from ``batches``.

        Returns:
            The step's mean loss as a tensor (not synchronised: read it with ``.item()`` when
            you need the number).
        """
        total = torch.zeros((), device=self.device)
        n = self.accumulation_steps
        for i in range(n):
            quiet = self.ddp is not None and self.no_sync and i < n - 1
            with self.ddp.no_sync() if quiet else contextlib.nullcontext():
                loss = self._backward(next(batches), loss_fn)
            total += loss.detach()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _backward(self, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One micro-batch's forward, loss and (scaled) backward; its share of the step's loss."""
        batch = self.to_device(batch)
        with self.autocast():
            loss = loss_fn(call_model(self.model, batch), batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InputError(
                f"`loss_fn` must return a scalar tensor, but returned {type(loss).__name__}"
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
            )
        loss = loss.float().reshape(()) / self.accumulation_steps
        self.scaler.scale(loss).backward()
        return loss


class FixedOrder(torch.utils.data.Sampler):
    """An endless stream of sample indices, each epoch a seeded permutation cut to a multiple of
    ``chunk``: every micro-batch size that divides ``chunk`` reads the same samples in the same
    order, so trials with different micro-batches train on identical effective batches."""

    def __init__(self, n_samples: int, chunk: int, seed: int) -> None:
        self.n_samples, self.chunk, self.seed = n_samples, chunk, seed

    def __iter__(self) -> Iterator[int]:
        usable = self.n_samples - self.n_samples % self.chunk
        epoch = 0
        while True:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            yield from torch.randperm(self.n_samples, generator=generator)[:usable].tolist()
            epoch += 1


def accumulation(batch_size: int, effective_batch_size: int | None) -> tuple[int, int]:
    """(accumulation steps, effective batch size) of a micro-batch size.

    Raises:
        TrialError: kind ``unsupported`` when ``batch_size`` does not divide the effective batch.
    """
    if effective_batch_size is None:
        return 1, batch_size
    if batch_size > effective_batch_size or effective_batch_size % batch_size:
        raise TrialError(
            "unsupported",
            f"batch_size {batch_size} does not divide the effective batch size {effective_batch_size}",
        )
    return effective_batch_size // batch_size, effective_batch_size


def prepare(
    model: torch.nn.Module,
    config: Mapping[str, Any],
    device: str,
    make_optimizer: Callable[[Iterable[Any]], torch.optim.Optimizer],
    dataset: Any,
    *,
    effective_batch_size: int | None = None,
    sampler: Any = None,
    shuffle: bool = True,
    copy_model: bool = True,
) -> TrainingSetup:
    """Build the training pieces of ``config`` for ``model`` (see :func:`autotune.training`).

    Args:
        sampler: The loader's sampler (the trials' :class:`FixedOrder`); without one, the
            loader shuffles with ``shuffle`` and drops the last short batch (one shape for a
            compiled model).
    """
    config = Config(config)
    n_accumulate, effective = accumulation(config.batch_size, effective_batch_size)
    amp = None if config.amp_dtype == "float32" else config.amp_dtype
    # Autocast wraps the forward and the loss here (the usual recipe), not the model alone.
    state = build(model, config.but(amp_dtype="float32"), device, copy_model=copy_model)
    tuned = state.model.train()
    try:
        optimizer = with_impl(make_optimizer(unwrap(tuned).parameters()), state.optimizer_impl)
    except TrialError:
        raise
    except Exception as exc:
        raise InputError(f"The optimizer factory raised {type(exc).__name__}: {exc}") from exc
    loader = _loader(dataset, state, device, sampler, shuffle)
    return TrainingSetup(
        model=tuned,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler(torch.device(device).type, enabled=amp == "float16"),
        loader=loader,
        accumulation_steps=n_accumulate,
        batch_size=config.batch_size,
        effective_batch_size=effective,
        amp_dtype=amp,
        device=device,
        non_blocking=state.non_blocking,
        settings=dict(state.settings),
        channels_last=state.channels_last,
    )


def _loader(dataset: Any, state: Any, device: str, sampler: Any, shuffle: bool) -> Any:
    """The micro-batches' loader through the configuration's data path: the samples on the device
    (``device_resident``) or gathered a batch at a time (``gather``), then fed ahead
    (``feed_ahead``, ``device_prefetch``). The same batches as a plain DataLoader's."""
    from autotune.knobs.gather import as_batch, gathered
    from autotune.knobs.prefetch import fed
    from autotune.knobs.resident import host_free_kwargs, on_device, resident

    kwargs = dict(state.loader_kwargs)
    if state.device_resident:
        dataset = resident(dataset, device)
    elif state.gather == "batched":
        pin = bool(kwargs.get("pin_memory")) and not kwargs.get("num_workers")
        dataset = gathered(dataset, pin=pin) or dataset
    if hasattr(dataset, "fields"):  # whole batches come from the dataset
        kwargs["collate_fn"] = as_batch
    if on_device(dataset) or state.device_resident:  # read on the device: no workers, nothing to pin
        kwargs = host_free_kwargs(kwargs)
    if sampler is not None:
        loader = torch.utils.data.DataLoader(dataset, sampler=sampler, **kwargs)
    else:
        loader = torch.utils.data.DataLoader(dataset, shuffle=shuffle, drop_last=True, **kwargs)
    return fed(loader, state, device)


def check_training(
    loss_fn: Any,
    optimizer: Any,
    test_dataset: Any,
    export: Any,
    loss_tolerance: Any,
    n_train_steps: Any,
    train_dataset: Any = None,
    effective: Any = None,
    allow_change: bool = False,
    baseline_batch_size: int | None = 32,
) -> None:
    """Check ``optimize``'s training-mode options before anything runs.

    Raises:
        ConfigError: what is wrong and how to fix it.
    """
    if loss_fn is None or not callable(loss_fn):
        raise ConfigError("Training mode needs `loss_fn(outputs, batch) -> Tensor`, the loss your training step uses.")
    optimizer_factory(optimizer)
    if test_dataset is not None:
        raise ConfigError("`test_dataset` is scored in inference mode only; in training mode pass `metric` instead.")
    if train_dataset is not None:
        raise ConfigError(
            "In training mode `dataset` is what the steps train on; pass it as `dataset`, not `train_dataset`."
        )
    if allow_change and effective is not None:
        raise ConfigError("Give either `effective_batch_size` or `allow_batch_change=True`, not both.")
    if effective is not None and (isinstance(effective, bool) or not isinstance(effective, int) or effective < 1):
        raise ConfigError(f"`effective_batch_size` must be a positive integer, but got {effective!r}.")
    if not allow_change and effective is not None and baseline_batch_size and effective % baseline_batch_size:
        raise ConfigError(
            f"`effective_batch_size` {effective} is not a multiple of the baseline's micro-batch "
            f"(baseline_batch_size={baseline_batch_size}); pass the batch size your loop uses now as "
            "baseline_batch_size, one that divides the effective batch."
        )
    if export:
        raise ConfigError("Training mode exports nothing: it tunes the training step. Leave `export` unset.")
    if isinstance(loss_tolerance, bool) or not isinstance(loss_tolerance, (int, float)) or not 0 < loss_tolerance < 1:
        raise ConfigError(f"`loss_tolerance` must be in (0, 1), a relative change, but got {loss_tolerance!r}.")
    if isinstance(n_train_steps, bool) or not isinstance(n_train_steps, int) or n_train_steps < 2:
        raise ConfigError(f"`n_train_steps` must be an integer of at least 2, but got {n_train_steps!r}.")


def check_effective(effective: Any, allow_change: bool, baseline_batch_size: int, data: Any) -> int | None:
    """The effective batch size of a training study (``None``: it follows the micro-batch)."""
    if allow_change:
        return None
    effective = baseline_batch_size if effective is None else effective
    if effective % baseline_batch_size:  # the micro-batch known now (a DataLoader's, say)
        raise ConfigError(
            f"`effective_batch_size` {effective} is not a multiple of the baseline's micro-batch "
            f"({baseline_batch_size}); pass one that it divides, or allow_batch_change=True."
        )
    if effective > data.n_samples:
        raise ConfigError(
            f"`effective_batch_size` {effective} is larger than the dataset ({data.n_samples} samples); lower it."
        )
    return effective


def optimizer_name(optimizer: Any) -> str:
    """A short, readable name of an ``optimizer`` option (for best_config.json)."""
    if isinstance(optimizer, tuple):
        return f"{optimizer[0].__name__}({', '.join(f'{k}={v!r}' for k, v in dict(optimizer[1]).items())})"
    return (
        getattr(optimizer, "__qualname__", None)
        or getattr(getattr(optimizer, "func", None), "__name__", None)
        or repr(optimizer)
    )


def train_metric(setup: TrainingSetup, samples: list[Any], metric: Any) -> float:
    """The user's metric after training: the trained weights in eval mode, eager (no
    recompilation for eval), under the configuration's autocast, over fixed batches."""
    from torch.utils.data import default_collate

    from autotune.knobs.state import wrap

    inner = unwrap(setup.model)
    model = wrap(setup, inner)
    was_training = inner.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.inference_mode():
            for start in range(0, len(samples), setup.batch_size):
                batch = default_collate(samples[start : start + setup.batch_size])
                on_device = setup.to_device(batch)
                value = float(metric(call_model(model, on_device), on_device))
                n = len(samples[start : start + setup.batch_size])
                total, count = total + value * n, count + n
    finally:
        inner.train(was_training)
    return total / count
