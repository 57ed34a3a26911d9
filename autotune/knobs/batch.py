"""``batch_size``: samples per batch of the DataLoader and of the model."""

from __future__ import annotations

from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

# Powers of two and the 1.5x steps between them: fine enough near the usual optimum.
_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# One batch of inputs may take at most this share of the device's memory: activations,
# weights and the loader's prefetched batches need the rest.
_MAX_BATCH_MEM_SHARE = 0.1


@register
class BatchSize(Knob):
    name = "batch_size"
    side = "both"
    order = 10
    stage = Stage.LOADER
    choices = _SIZES
    default = 32
    help = "Samples per batch. Larger batches use the hardware better until memory or cache runs out."

    def offer(self, ctx: SpaceContext) -> Offer:
        values, excluded = [], {}
        limit = int(ctx.env.device_mem_bytes * _MAX_BATCH_MEM_SHARE)
        effective = ctx.effective_batch_size
        for size in self.choices:
            if effective is not None and (size > effective or effective % size):
                excluded[str(size)] = (
                    f"does not divide the effective batch size {effective} (allow_batch_change=True lifts this)"
                )
            elif size > ctx.data.n_samples:
                excluded[str(size)] = f"larger than the dataset ({ctx.data.n_samples} samples)"
            elif size * ctx.data.sample_bytes > limit:
                excluded[str(size)] = (
                    f"one batch of inputs would take {size * ctx.data.sample_bytes / 2**20:.0f} MiB, "
                    f"over {_MAX_BATCH_MEM_SHARE:.0%} of the device's memory"
                )
            else:
                values.append(size)
        return Offer(values, excluded)

    def baseline(self, ctx: SpaceContext) -> int:
        return min(ctx.baseline_batch_size, ctx.data.n_samples)

    # In training mode the value is the micro-batch: gradients of ``effective // batch_size``
    # micro-batches are accumulated into one optimizer step.

    def validate(self, value: Any) -> int:
        from autotune.errors import ConfigError

        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"Knob 'batch_size' must be a positive integer, but got {value!r}.")
        return value

    def apply(self, state: Any, value: int) -> None:
        state.batch_size = value
        state.loader_kwargs["batch_size"] = value
