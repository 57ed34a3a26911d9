"""Process-wide settings active while the model runs: ``num_threads``, ``cudnn_benchmark``, ``tf32``."""

from __future__ import annotations

from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register


@register
class NumThreads(Knob):
    name = "num_threads"
    order = 80
    stage = Stage.RUNTIME
    choices = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    default = None
    help = "Intra-op CPU threads (torch.set_num_threads). Fewer threads can win when loader workers compete for cores."

    def offer(self, ctx: SpaceContext) -> Offer:
        n = ctx.env.cpu_threads
        if ctx.env.is_cuda:
            return Offer([n], {str(c): "intra-op threads are tuned on CPU only" for c in self.choices if c != n})
        values = sorted({c for c in self.choices if c <= n} | {n})
        return Offer(
            values,
            {str(c): f"more threads than torch's default ({n}, the physical cores)" for c in self.choices if c > n},
        )

    def baseline(self, ctx: SpaceContext) -> int:
        return ctx.env.cpu_threads

    def validate(self, value: Any) -> int | None:
        from autotune.errors import ConfigError

        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"Knob 'num_threads' must be a positive integer, but got {value!r}.")
        return value

    def apply(self, state: Any, value: int | None) -> None:
        if value is not None:
            state.settings["num_threads"] = value

    def activate(self, value: int | None) -> None:
        import torch

        if value:
            torch.set_num_threads(value)


class _CudaOnly(Knob):
    choices = (False, True)
    default = False

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.env.is_cuda:
            return Offer([False, True])
        return Offer([False], {"true": "a CUDA setting; trials run on the CPU"})


@register
class CudnnBenchmark(_CudaOnly):
    name = "cudnn_benchmark"
    per_shape = True
    screen = (True,)
    screen_rank = 140
    order = 81
    stage = Stage.RUNTIME
    help = "Let cuDNN time its convolution algorithms for each shape and keep the fastest. CUDA only."

    def apply(self, state: Any, value: bool) -> None:
        state.settings["cudnn_benchmark"] = value

    def activate(self, value: bool) -> None:
        import torch

        torch.backends.cudnn.benchmark = value


@register
class Tf32(_CudaOnly):
    name = "tf32"
    numerics = True
    screen = (True,)
    screen_rank = 150
    order = 82
    stage = Stage.RUNTIME
    help = (
        "TF32 tensor-core math for float32 matmuls and convolutions (fp32_precision 'tf32' for cuBLAS and "
        "cuDNN convolutions). CUDA sm80+."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        env = ctx.env
        if env.is_cuda and env.gpu_capability and env.gpu_capability < (8, 0):
            return Offer(
                [False], {"true": f"TF32 needs compute capability 8.0+, {env.gpu_name} has {env.gpu_capability}"}
            )
        return super().offer(ctx)

    def apply(self, state: Any, value: bool) -> None:
        state.settings["tf32"] = value

    def activate(self, value: bool) -> None:
        # False leaves PyTorch's defaults alone (float32 matmuls in full precision, cuDNN
        # convolutions allowed TF32, as stock PyTorch has them): the baseline is stock PyTorch.
        if value:
            from autotune._pristine import set_tf32

            set_tf32()
