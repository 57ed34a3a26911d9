"""DataLoader knobs: ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``.

The batched gather and the device prefetcher live in :mod:`autotune.knobs.gather` and
:mod:`autotune.knobs.prefetch`.
"""

from __future__ import annotations

from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register


class _LoaderKnob(Knob):
    def applies(self, config: dict[str, Any]) -> bool:
        # With the samples on the device (device_resident) the loader reads in the calling
        # process and pins nothing: its workers and pinning do not apply.
        return not config.get("device_resident", False)

    def baseline(self, ctx: SpaceContext) -> Any:
        # A DataLoader given as the dataset is the baseline: its own settings, where they are values.
        value = ctx.loader.get(self.name, self.default)
        return value if value in self.choices and type(value) is type(self.default) else self.default


@register
class NumWorkers(_LoaderKnob):
    name = "num_workers"
    side = "loader"
    order = 20
    stage = Stage.LOADER
    choices = (0, 1, 2, 3, 4, 6, 8, 12, 16)
    default = 0
    help = "DataLoader worker processes. Helps when loading or decoding samples is the bottleneck."

    def offer(self, ctx: SpaceContext) -> Offer:
        from autotune.env import usable_cpus

        # The CPUs this process may use (affinity, cgroup quota), not the machine's: in a
        # container given 4 of 64 cores, 16 workers would take turns on 4.
        cpus = usable_cpus()
        values = [n for n in self.choices if n <= cpus]
        why = f"more workers than the CPUs this process may use ({cpus}: its affinity and CPU quota)"
        return Offer(values, {str(n): why for n in self.choices if n > cpus})

    def apply(self, state: Any, value: int) -> None:
        state.loader_kwargs["num_workers"] = value


class _NeedsWorkers(_LoaderKnob):
    def applies(self, config: dict[str, Any]) -> bool:
        return super().applies(config) and config.get("num_workers", 0) > 0


@register
class PrefetchFactor(_NeedsWorkers):
    name = "prefetch_factor"
    side = "loader"
    order = 21
    stage = Stage.LOADER
    choices = (2, 4, 8)
    default = 2
    help = "Batches each loader worker prepares ahead. Only with num_workers > 0."

    def apply(self, state: Any, value: int) -> None:
        if state.loader_kwargs.get("num_workers", 0) > 0:
            state.loader_kwargs["prefetch_factor"] = value


@register
class PersistentWorkers(_NeedsWorkers):
    name = "persistent_workers"
    side = "loader"
    order = 22
    stage = Stage.LOADER
    choices = (False, True)
    default = False
    help = "Keep loader workers alive between epochs instead of restarting them. Only with num_workers > 0."

    def apply(self, state: Any, value: bool) -> None:
        if state.loader_kwargs.get("num_workers", 0) > 0:
            state.loader_kwargs["persistent_workers"] = value


@register
class PinMemory(_LoaderKnob):
    name = "pin_memory"
    side = "loader"
    order = 23
    stage = Stage.LOADER
    choices = (False, True)
    default = False
    help = "Page-locked host buffers, so batches reach the GPU faster and asynchronously. CUDA only."

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.env.is_cuda:
            return Offer([False, True])
        return Offer([False], {"true": "pinned memory only speeds up copies to a CUDA device"})

    def apply(self, state: Any, value: bool) -> None:
        state.loader_kwargs["pin_memory"] = value
        state.non_blocking = value
