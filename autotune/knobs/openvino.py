"""The OpenVINO settings of ``runtime=openvino``: ``ov_precision`` and ``ov_hint``, read by
the OpenVINO runtime's build (:mod:`autotune.runtimes.openvino`)."""

from __future__ import annotations

from typing import Any

from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register

__all__ = ["OvHint", "OvPrecision", "bf16_units"]


def bf16_units() -> bool:
    """Whether this CPU has bfloat16 units (AVX512-BF16 or AMX-BF16), where OpenVINO's bf16
    inference precision pays; elsewhere the plugin would emulate it."""
    from autotune.env import cpu_info

    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_info()["isa"]))


class _OvKnob(Knob):
    stage = Stage.COMPILE
    modes = ("inference",)

    def applies(self, config: dict[str, Any]) -> bool:
        return config.get("runtime") == "openvino"

    def apply(self, state: Any, value: Any) -> None:
        pass  # read by the OpenVINO runtime when it builds the candidate


@register
class OvPrecision(_OvKnob):
    name = "ov_precision"
    prices = True
    held = True
    order = 65  # after runtime; before int8_fallback, which applies to int8_static
    choices = ("fp32", "bf16", "int8_static")
    default = "fp32"
    help = (
        "The OpenVINO candidate's precision: float32; bfloat16 inference precision (CPUs with bf16 "
        "units); or NNCF static int8, calibrated on dataset batches, its most sensitive layers kept "
        "float by int8_fallback."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        values, excluded = ["fp32"], {}
        if bf16_units():
            values.append("bf16")
        else:
            excluded["bf16"] = "this CPU has no bfloat16 units (AVX512-BF16 or AMX): OpenVINO would emulate it"
        if ctx.no_calibration:  # NNCF observes activation ranges on calibration batches
            excluded["int8_static"] = ctx.no_calibration
        else:
            values.append("int8_static")
        return Offer(values, excluded)


@register
class OvHint(_OvKnob):
    name = "ov_hint"
    order = 66
    choices = ("latency", "throughput")
    default = "latency"
    help = (
        "OpenVINO's performance hint: one stream on every thread (latency), or several streams, each "
        "batch split over as many infer requests as OpenVINO finds best (throughput)."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.env.cpu_threads < 2:
            return Offer(["latency"], {"throughput": "one CPU thread: a second stream has no core to run on"})
        return Offer(list(self.choices))
