"""Training across processes: ``world_size`` and ``DistributedDataParallel``'s own knobs.

A training trial with ``world_size`` N > 1 runs its step in N processes started by PyTorch's own
launcher (``torch.distributed.run``, torchrun's elastic agent), one per GPU (``nccl``) or, on a
CPU, each on its share of the cores (``gloo``); the model is wrapped in
``DistributedDataParallel`` and each rank reads its slice of every global batch. The effective
batch is global: micro-batch x accumulation x world size, so the loss curve is compared with the
single-process baseline's at the same effective batch (:mod:`autotune.trial.ddp`).

The DDP knobs apply only with ``world_size`` > 1. ``find_unused_parameters`` is not searched: it
is detected (on only where the model leaves parameters without a gradient).
"""

from __future__ import annotations

from typing import Any, ClassVar

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

__all__ = ["WORLD_SIZES", "WorldSize", "launch_record"]

WORLD_SIZES = (1, 2, 4, 8)


def launch_record(config: dict[str, Any], trial: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """How to run a training config of ``world_size`` > 1 in the user's own script: the torchrun
    command lines for one machine and for several, and the DDP settings
    (``find_unused_parameters`` as the trial detected it); ``None`` for one process.

    Example:
        >>> launch_record({"world_size": 2, "ddp_bucket_cap_mb": 25, "ddp_no_sync": True})["one_machine"]
        'torchrun --standalone --nproc-per-node=2 train.py'
    """
    world = int(config.get("world_size", 1))
    if world <= 1:
        return None
    names = ("ddp_bucket_cap_mb", "ddp_bucket_view", "ddp_static_graph", "ddp_broadcast_buffers", "ddp_no_sync",
             "ddp_zero1")  # fmt: skip
    return {
        "world_size": world,
        "one_machine": f"torchrun --standalone --nproc-per-node={world} train.py",
        "machines": (
            f"torchrun --nnodes=N --nproc-per-node={world} --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 train.py"
            "  # on each of the N machines; HOST is one of them"
        ),
        "ddp": {name: config[name] for name in names if name in config},
        "find_unused_parameters": bool((trial or {}).get("find_unused_parameters", False)),
        "script": "train.py calls autotune.training(model, optimizer, dataset, 'best_config.json'): "
        "it joins the process group, wraps the model in DDP and reads its share of each batch",
    }


def _devices(ctx: SpaceContext) -> int:
    """Ranks the machine can hold: its GPUs on CUDA, else the CPUs this process may use."""
    if ctx.env.is_cuda:
        import torch

        return torch.cuda.device_count()
    from autotune.env import usable_cpus

    return usable_cpus()


@register
class WorldSize(Knob):
    name = "world_size"
    order = 88
    stage = Stage.RUNTIME
    choices = WORLD_SIZES
    default = 1
    modes = ("train",)
    help = (
        "Training processes, each a DistributedDataParallel rank launched by torchrun: one per GPU (nccl), or on "
        "a CPU each on its share of the cores (gloo). The effective batch is global: micro-batch x accumulation x "
        "world size."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        n = _devices(ctx)
        what = "GPUs" if ctx.env.is_cuda else "CPUs this process may use"
        values = [w for w in self.choices if w <= n]
        excluded = {str(w): f"more ranks than the {what} ({n})" for w in self.choices if w > n}
        effective = ctx.effective_batch_size
        if effective is not None:  # each rank takes an equal share of every optimizer step's samples
            for w in list(values):
                if effective % w:
                    values.remove(w)
                    excluded[str(w)] = f"the effective batch size {effective} does not split into {w} equal shares"
        return Offer(values, excluded)

    def apply(self, state: Any, value: int) -> None:
        state.settings["world_size"] = value


class _DDPKnob(Knob):
    stage = Stage.RUNTIME
    modes = ("train",)
    # The DistributedDataParallel argument the knob sets, if it sets one (autotune.trial.ddp_steps).
    ddp_argument: ClassVar[str | None] = None

    def applies(self, config: dict[str, Any]) -> bool:
        return config.get("world_size", 1) > 1

    def apply(self, state: Any, value: Any) -> None:
        state.settings[self.name] = value


@register
class BucketCap(_DDPKnob):
    name = "ddp_bucket_cap_mb"
    ddp_argument = "bucket_cap_mb"
    order = 89
    choices = (25, 5, 100)
    default = 25
    help = "DistributedDataParallel's gradient bucket size in MiB: smaller buckets start all-reduces earlier."


@register
class BucketView(_DDPKnob):
    name = "ddp_bucket_view"
    ddp_argument = "gradient_as_bucket_view"
    order = 89
    choices = (False, True)
    default = False
    help = "gradient_as_bucket_view: gradients are views into the all-reduce buckets (one copy and its memory less)."


@register
class StaticGraph(_DDPKnob):
    name = "ddp_static_graph"
    ddp_argument = "static_graph"
    order = 89
    choices = (False, True)
    default = False
    help = "static_graph: the same parameters are used every step, so DDP plans its all-reduces once."


@register
class NoSync(_DDPKnob):
    name = "ddp_no_sync"
    order = 89
    choices = (True, False)
    default = True
    help = "All-reduce gradients only on an optimizer step's last micro-batch (no_sync on the accumulation steps)."


@register
class BroadcastBuffers(_DDPKnob):
    name = "ddp_broadcast_buffers"
    ddp_argument = "broadcast_buffers"
    order = 89
    choices = (True, False)
    default = True
    help = "Broadcast rank 0's buffers (batch-norm statistics) at every forward, as DDP does by default."


@register
class Zero1(_DDPKnob):
    name = "ddp_zero1"
    order = 89
    choices = (False, True)
    default = False
    help = "ZeRO-1: shard the optimizer's state across the ranks (ZeroRedundancyOptimizer), the memory lever."
