"""The runtime that runs the tuned model: ``runtime`` and the ONNX Runtime settings
``ort_provider``, ``ort_precision``, ``ort_graph_optimization`` and ``ort_io_binding`` (the
OpenVINO ones are in :mod:`autotune.knobs.openvino`).

``runtime``'s values are PyTorch's and those of the runtimes registered in
:mod:`autotune.runtimes`, each of which builds its own candidate. A TorchScript, ONNX Runtime or
OpenVINO candidate is exported inside its trial and measured end to end like any other, so it
competes with the torch-side candidates under the same guard.
"""

from __future__ import annotations

from typing import Any

from autotune.export.scratch import candidate_dir
from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register
from autotune.runtimes.base import get_runtime, names


@register
class Runtime(Knob):
    name = "runtime"
    reads_inputs = True
    code = "path"
    deploy = True
    heavy = True
    order = 40
    modes = ("inference",)
    stage = Stage.COMPILE
    default = "torch"

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        # PyTorch, then every registered runtime: a runtime's module is all that names it.
        return ("torch", *names())

    @property
    def help(self) -> str:  # type: ignore[override]
        *first, last = ["PyTorch", *(get_runtime(name).help for name in names())]
        return f"What runs the model: {', '.join(first)}, or {last}."

    def offer(self, ctx: SpaceContext) -> Offer:
        values, excluded = ["torch"], {}
        for name in names():
            why = get_runtime(name).problem(ctx)
            if why is None:
                values.append(name)
            else:
                excluded[name] = why
        return Offer(values, excluded)

    def apply(self, state: Any, value: str) -> None:
        if value == "torch":
            return
        from autotune.errors import TrialError
        from autotune.knobs.compress import _extras

        extras = _extras(state, "runtime")
        folder = candidate_dir()
        state.torch_model = state.model
        try:
            state.model, info = get_runtime(value).build(state, extras, folder)
        except TrialError:
            raise
        except Exception as exc:  # an exporter's failure rules this candidate out, nothing more
            raise TrialError("unsupported", f"{value} export failed: {type(exc).__name__}: {exc}") from exc
        state.info.update({f"{value}_{k}": v for k, v in info.items() if isinstance(v, (str, int, float, bool))})
        state.runtime = value


class _OrtKnob(Knob):
    stage = Stage.COMPILE
    modes = ("inference",)

    def applies(self, config: dict[str, Any]) -> bool:
        return config.get("runtime") == "onnxruntime"

    def apply(self, state: Any, value: Any) -> None:
        pass  # read by the ONNX Runtime runtime when it builds its session


@register
class OrtProvider(_OrtKnob):
    name = "ort_provider"
    deploy = True
    order = 70
    choices = ("CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider")
    default = "CPUExecutionProvider"
    help = "ONNX Runtime execution provider, from those installed and usable on this device."

    def offer(self, ctx: SpaceContext) -> Offer:
        if not ctx.env.is_cuda:
            return Offer(["CPUExecutionProvider"], {p: "trials run on the CPU" for p in self.choices[1:]})
        from autotune.export.ort import provider_problem

        # A listed provider whose libraries do not load runs a session on the CPU without a word:
        # offered only where a session really gets it.
        problems = {p: provider_problem(p) for p in self.choices[1:]}
        values = ["CPUExecutionProvider", *(p for p, why in problems.items() if why is None)]
        return Offer(values, {p: why for p, why in problems.items() if why is not None})


@register
class OrtPrecision(_OrtKnob):
    name = "ort_precision"
    code = "path"
    deploy = True
    heavy = True
    order = 71
    choices = ("fp32", "fp16", "int8_dynamic", "int8_static")
    default = "fp32"
    help = "The ONNX graph's precision: float32, float16 (CUDA), or INT8 by onnxruntime.quantization (dynamic for MatMul-heavy models, static QDQ calibrated on dataset batches for convolutional ones)."

    def offer(self, ctx: SpaceContext) -> Offer:
        values = list(self.choices) if ctx.env.is_cuda else ["fp32", "int8_dynamic", "int8_static"]
        excluded = {} if ctx.env.is_cuda else {"fp16": "float16 ONNX pays off on CUDA only"}
        if ctx.no_calibration:  # static int8 observes activation ranges on calibration batches
            values.remove("int8_static")
            excluded["int8_static"] = ctx.no_calibration
        return Offer(values, excluded)


@register
class OrtGraphOptimization(_OrtKnob):
    name = "ort_graph_optimization"
    order = 72
    choices = ("basic", "extended", "all")
    default = "all"
    help = "ONNX Runtime's graph optimization level (constant folding, node fusions, layout changes)."


@register
class OrtIoBinding(_OrtKnob):
    name = "ort_io_binding"
    order = 73
    choices = (False, True)
    default = False
    help = "Bind CUDA tensors to ONNX Runtime directly, without copies through host memory. CUDA only."

    def applies(self, config: dict[str, Any]) -> bool:
        # With the CPU provider the inputs go through host memory whatever is bound.
        return super().applies(config) and config.get("ort_provider", "CPUExecutionProvider") != "CPUExecutionProvider"

    def offer(self, ctx: SpaceContext) -> Offer:
        if not ctx.env.is_cuda:
            return Offer([False], {"true": "I/O binding avoids host copies of CUDA tensors; trials run on the CPU"})
        from autotune.export.ort import CUDA_PROVIDER, provider_problem

        why = provider_problem(CUDA_PROVIDER)
        if why is not None:
            return Offer(
                [False], {"true": f"I/O binding pays with the CUDA provider only, and {CUDA_PROVIDER} is {why}"}
            )
        return Offer([False, True])
