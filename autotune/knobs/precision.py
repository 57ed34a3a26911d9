"""``amp_dtype``: automatic mixed precision (autocast) for the forward pass."""

from __future__ import annotations

from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register
from autotune.runtimes.base import precision_knob


@register
class AmpDtype(Knob):
    name = "amp_dtype"
    memory = True
    code = "path"
    screen = ("bfloat16", "float16")
    screen_rank = 40
    first_tier = True
    order = 50
    stage = Stage.WEIGHTS
    choices = ("float32", "bfloat16", "float16")
    default = "float32"
    help = (
        "Autocast dtype: matrix products and convolutions run in 16-bit where safe. "
        "Large speedups on tensor cores and AVX-512/AMX CPUs; outputs are cast back to float32."
    )

    def applies(self, config: dict[str, Any]) -> bool:
        # ONNX Runtime and OpenVINO have their own precision knobs (ort_precision, ov_precision).
        return precision_knob(config.get("runtime", "torch")) is None

    def offer(self, ctx: SpaceContext) -> Offer:
        env = ctx.env
        values, excluded = ["float32"], {}
        if env.bf16:
            values.append("bfloat16")
        elif env.is_cuda:
            excluded["bfloat16"] = f"{env.gpu_name} has no bfloat16 support (needs compute capability 8.0+)"
        else:
            excluded["bfloat16"] = (
                f"this CPU ({env.cpu_capability}) has no AVX-512 or AMX, so bfloat16 would be emulated slowly"
            )
        if env.fp16:
            values.append("float16")
        else:
            excluded["float16"] = "float16 autocast is offered on CUDA devices only"
        return Offer(values, excluded)

    def apply(self, state: Any, value: str) -> None:
        from autotune.errors import TrialError

        if value != "float32" and state.device == "cpu" and state.quantization in ("int8_dynamic", "int8_static"):
            # Known before anything runs: ruled out at once, without a failed trial and a worker restart.
            raise TrialError(
                "unsupported",
                f"{value} autocast does not combine with CPU {state.quantization}: its kernels take float32",
            )
        state.amp_dtype = None if value == "float32" else value
