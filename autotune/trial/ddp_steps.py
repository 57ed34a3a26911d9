"""A rank's work in a distributed training trial (:mod:`autotune.trial.ddp`): its setup wrapped in
``DistributedDataParallel``, the guard's steps and the timed windows."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from autotune.config import values_of, with_values
from autotune.errors import TrialError
from autotune.knobs.compiler import importable_globals
from autotune.samples import call_model

__all__ = ["RankSlice", "ddp_kwargs", "distribute", "join", "train_rank", "unused_parameters"]


def ddp_kwargs(config: Mapping[str, Any], find_unused: bool) -> dict[str, Any]:
    """``DistributedDataParallel``'s keyword arguments for ``config``: those the knobs that
    declare a ``ddp_argument`` set.

    Example:
        >>> ddp_kwargs(dict(ddp_bucket_cap_mb=5, ddp_static_graph=True), False)
        {'bucket_cap_mb': 5, 'static_graph': True, 'find_unused_parameters': False}
    """
    from autotune.knobs import REGISTRY

    arguments = {name: getattr(knob, "ddp_argument", None) for name, knob in REGISTRY.items()}
    found = {arg: config[name] for name, arg in arguments.items() if arg and name in config}
    return {**found, "find_unused_parameters": find_unused}


def unused_parameters(model: torch.nn.Module, batch: Any, loss_fn: Any) -> bool:
    """Whether one forward and backward of ``model`` on ``batch`` leaves a trainable parameter
    without a gradient (DDP then needs ``find_unused_parameters``). The model's weights, buffers
    and gradients are as before."""
    saved = copy.deepcopy(model.state_dict())
    try:
        model.zero_grad(set_to_none=True)
        loss_fn(call_model(model, batch), batch).float().sum().backward()
        return any(p.requires_grad and p.grad is None for p in model.parameters())
    finally:
        model.zero_grad(set_to_none=True)
        model.load_state_dict(saved)


class RankSlice(torch.utils.data.Sampler):
    """Rank ``rank``'s share of each global batch of ``order``'s stream: of every ``effective``
    consecutive indices, the ``rank``-th of ``world`` equal slices.

    Example:
        >>> from autotune.trial.train_setup import FixedOrder
        >>> stream = FixedOrder(8, 4, seed=0)
        >>> glob = [i for i, _ in zip(stream, range(8))]
        >>> ranks = [[i for i, _ in zip(RankSlice(stream, r, 2, 4), range(4))] for r in (0, 1)]
        >>> ranks[0] == glob[0:2] + glob[4:6] and ranks[1] == glob[2:4] + glob[6:8]
        True
    """

    def __init__(self, order: Any, rank: int, world: int, effective: int) -> None:
        self.order, self.rank, self.world, self.effective = order, rank, world, effective

    def __iter__(self) -> Iterator[int]:
        share = self.effective // self.world
        chunk: list[int] = []
        for index in self.order:
            chunk.append(index)
            if len(chunk) == self.effective:
                yield from chunk[self.rank * share : (self.rank + 1) * share]
                chunk = []


class _Counted:
    """How many buckets :func:`_counted_allreduce` all-reduced."""

    def __init__(self) -> None:
        self.n = 0


def _counted_allreduce(state, bucket):  # no annotations: DDP refuses a hook whose annotations are strings
    """A DDP communication hook: the default all-reduce, counted in ``state``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.n += 1
    return allreduce_hook(None, bucket)


def train_rank(spec: Any, config: Mapping[str, Any], rank: int, world: int, device: str) -> dict[str, Any]:
    """This rank's part of the trial; rank 0's return value is the trial's figures."""
    from autotune.trial.context import instantiate_model
    from autotune.trial.train_setup import FixedOrder, optimizer_factory, prepare

    knobs = values_of(config)
    effective = spec.effective_batch_size or world * int(knobs.batch_size)
    if effective % world:
        raise TrialError("unsupported", f"the effective batch size {effective} does not split into {world} ranks")
    torch.manual_seed(spec.seed)
    model = instantiate_model(spec)
    order = FixedOrder(len(spec.dataset), effective, spec.seed)
    plain = with_values(config, world_size=1, compile_mode="none")  # compiled around DDP, below
    setup = prepare(model, plain, device, optimizer_factory(spec.optimizer), spec.dataset,
                    effective_batch_size=effective // world, sampler=RankSlice(order, rank, world, effective),
                    copy_model=False)  # fmt: skip
    probe = setup.to_device(next(iter(setup.loader)))
    with setup.autocast():
        find_unused = unused_parameters(setup.model, probe, spec.loss_fn)
    counter = distribute(setup, config, find_unused)
    ddp = setup.ddp
    guard = _guard(setup, spec, world, counter)
    if spec.metric is not None and rank == 0:  # the user's metric of the trained weights, eager
        import dataclasses

        from autotune.trial.train_setup import train_metric

        samples = [spec.dataset[i] for i in spec.val_indices]
        guard["metric"] = train_metric(dataclasses.replace(setup, model=ddp.module), samples, spec.metric)
    timed = _timed(setup, guard.pop("batches"), spec)
    return {**guard, **timed, "world_size": world, "find_unused_parameters": find_unused,
            "threads_per_rank": torch.get_num_threads(), "effective_batch_size": effective}  # fmt: skip


def join(config: Mapping[str, Any], device: str, dataset: Any, shuffle: bool, effective: int | None) -> tuple:
    """In a user's script started by torchrun: join the process group for ``config``'s
    ``world_size`` and return ``(this rank's device, its DistributedSampler, its share of the
    effective batch)``. Raises :class:`~autotune.errors.ConfigError` when the script was not
    started by torchrun with that many processes, saying how to start it."""
    import os

    from autotune.errors import ConfigError

    world = int(values_of(config).world_size)
    command = " ".join(["torchrun", "--standalone", f"--nproc-per-node={world}", "your_script.py"])
    if int(os.environ.get("WORLD_SIZE", "1")) != world:
        raise ConfigError(
            f"This config trains in {world} processes (world_size={world}), but this process was started as "
            f"{os.environ.get('WORLD_SIZE', 'one')} of them: run `{command}` (best_config.json's `launch`)."
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        from autotune.env import use_device

        device = f"cuda:{local}"
        use_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=world, rank=dist.get_rank(), shuffle=shuffle, drop_last=True)
    share = None if effective is None else effective // world
    if effective is not None and effective % world:
        raise ConfigError(f"The effective batch size {effective} does not split into {world} equal shares.")
    return device, sampler, share


def distribute(setup: Any, config: Mapping[str, Any], find_unused: bool = False) -> _Counted:
    """Wrap ``setup``'s model in ``DistributedDataParallel`` with ``config``'s DDP knobs (then
    compile the wrapper where ``config`` compiles), shard its optimizer's state with ZeRO-1 where
    asked, and make its step skip the all-reduce on accumulation steps where ``ddp_no_sync``
    says; returns the counter of all-reduced buckets. The process group must be up."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.device(setup.device).index or 0] if str(setup.device).startswith("cuda") else None
    ddp = DistributedDataParallel(setup.model, device_ids=ids, **ddp_kwargs(config, find_unused))
    counter = _Counted()
    ddp.register_comm_hook(counter, _counted_allreduce)
    knobs = values_of(config)
    if knobs.ddp_zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        inner = setup.optimizer
        setup.optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=type(inner), **inner.defaults)
    setup.model = ddp if knobs.compile_mode == "none" else _compiled(ddp, config)
    setup.ddp, setup.no_sync = ddp, bool(knobs.ddp_no_sync)
    return counter


def _compiled(ddp: Any, config: Mapping[str, Any]) -> Any:
    knobs = values_of(config)
    mode = knobs.compile_mode
    options = {"mode": mode} if mode not in ("default", "default-freezing") else {}
    importable_globals(ddp)
    compiled = torch.compile(ddp, dynamic=bool(knobs.compile_dynamic) or None, **options)
    if not knobs.compile_dynamic:
        return compiled
    from autotune.export.parity import CompiledWith

    # With symbolic shapes the model's floats stay constants, as in every compile (one trace, not two).
    return CompiledWith(compiled, fixed_floats=True)


def _guard(setup: Any, spec: Any, world: int, counter: _Counted) -> dict[str, Any]:
    """The guard's steps (as many samples as the baseline's), each step's loss averaged over the
    ranks, the all-reduces per step counted."""
    torch.manual_seed(spec.seed)
    batches = iter(setup.loader)
    effective = setup.effective_batch_size * world
    n_steps = max(
        2, spec.n_train_steps * (spec.effective_batch_size or values_of(spec.baseline).batch_size) // effective
    )
    losses, skipped, compile_s = [], 0, 0.0
    start = time.perf_counter()
    for i in range(n_steps):
        scale = setup.scaler.get_scale() if setup.scaler.is_enabled() else None
        loss = setup.step(batches, spec.loss_fn).detach().float()
        dist.all_reduce(loss)  # gloo and nccl both reduce a tensor on the rank's device
        losses.append(float(loss) / world)
        if scale is not None and setup.scaler.get_scale() < scale:
            skipped += 1
        if i + 1 == min(spec.measure.warmup_batches, n_steps):
            compile_s = time.perf_counter() - start
    if not all(math.isfinite(v) for v in losses):
        raise TrialError("nan", "the training loss became NaN/inf in the distributed guard steps")
    return {"losses": losses, "skipped_steps": skipped, "compile_s": compile_s, "batches": batches,
            "allreduces_per_step": counter.n / n_steps, "accumulation_steps": setup.accumulation_steps}  # fmt: skip


def _timed(setup: Any, batches: Iterator[Any], spec: Any) -> dict[str, Any]:
    """Global samples/s in windows of whole steps; every rank ends a window at the same step (the
    slowest rank's clock decides), so no rank waits in an all-reduce the others never start."""
    from autotune.trial.measure import _sync, window_stats

    settings = spec.measure
    device = torch.device(setup.device)
    global_batch = setup.effective_batch_size * dist.get_world_size()
    windows, latencies = [], []
    started = time.perf_counter()
    for _ in range(settings.n_windows):
        dist.barrier()
        w_start, n = time.perf_counter(), 0
        while True:
            s_start = time.perf_counter()
            setup.step(batches, spec.loss_fn)
            _sync(device)
            latencies.append((time.perf_counter() - s_start) * 1e3)
            n += global_batch
            done = torch.tensor([float(time.perf_counter() - w_start >= settings.window_s)], device=device)
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                break
        windows.append(n / (time.perf_counter() - w_start))
    stats = window_stats(windows, latencies)
    return {**stats, "timed_s": time.perf_counter() - started, "n_windows": settings.n_windows, "others_cpu": 0.0}
