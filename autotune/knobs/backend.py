"""The runtime that runs the tuned model: ``runtime`` and the ONNX Runtime settings
``ort_provider``, ``ort_precision``, ``ort_graph_optimization`` and ``ort_io_binding`` (the
OpenVINO ones are in :mod:`autotune.knobs.openvino`).

A TorchScript, ONNX Runtime or OpenVINO candidate is exported inside its trial and measured end
to end like any other, so it competes with the torch-side candidates under the same guard.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from autotune.export.scratch import candidate_dir
from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register


def _ort_providers() -> list[str]:
    if importlib.util.find_spec("onnxruntime") is None:
        return []
    import onnxruntime

    return list(onnxruntime.get_available_providers())


@register
class Runtime(Knob):
    name = "runtime"
    heavy = True
    order = 40
    modes = ("inference",)
    stage = Stage.COMPILE
    choices = ("torch", "torchscript", "onnxruntime", "openvino")
    default = "torch"
    help = (
        "What runs the model: PyTorch, a frozen TorchScript trace, ONNX Runtime on the exported graph, "
        "or OpenVINO (CPU) on the converted model."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        values, excluded = ["torch", "torchscript"], {}
        if _ort_providers():
            values.append("onnxruntime")
        else:
            excluded["onnxruntime"] = "onnxruntime is not installed"
        why = _openvino_problem(ctx)
        if why is None:
            values.append("openvino")
        else:
            excluded["openvino"] = why
        return Offer(values, excluded)

    def apply(self, state: Any, value: str) -> None:
        if value == "torch":
            return
        from autotune.errors import TrialError
        from autotune.export import torchscript as ts
        from autotune.knobs.compress import _extras

        extras = _extras(state, "runtime")
        folder = candidate_dir()
        state.torch_model = state.model
        try:
            if value == "torchscript":
                import torch

                # Traced on the model's own device: a CPU example cannot run a CUDA model.
                info = ts.export_torchscript(state.model, extras.example_on(state.device), folder / "model.pt")
                script = torch.jit.load(str(folder / "model.pt"), map_location=state.device)
                state.model = ts.ScriptRunner(script, info["input_names"])
                state.artifact = {"format": "torchscript", **info, "path": str(folder / "model.pt")}
            elif value == "openvino":
                from autotune.knobs.openvino import build_openvino

                state.model, info = build_openvino(state, extras, folder)
            else:
                state.model, info = _ort_module(state, extras, folder)
        except TrialError:
            raise
        except Exception as exc:  # an exporter's failure rules this candidate out, nothing more
            raise TrialError("unsupported", f"{value} export failed: {type(exc).__name__}: {exc}") from exc
        state.info.update({f"{value}_{k}": v for k, v in info.items() if isinstance(v, (str, int, float, bool))})
        state.runtime = value


def _openvino_problem(ctx: SpaceContext) -> str | None:
    """Why ``runtime=openvino`` is not offered here, or ``None``."""
    if ctx.env.is_cuda:
        return "OpenVINO runs on the CPU; trials run on CUDA"
    from autotune.export.ov_run import openvino_problem

    return openvino_problem()


def _ort_module(state: Any, extras: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
    from autotune.export import onnx as ox

    config = state.config
    example = extras.example_on(state.device)  # the model may be on CUDA; the example is kept on the CPU
    info = ox.export_onnx(state.model, example, folder / "model.onnx", spatial=bool(extras.ragged))
    # Read from the run's cache, or what a rebuild reading it skips: the finish prices rebuilds so.
    state.info.update({k: info[k] for k in ("onnx_cached", "onnx_export_s") if k in info})
    path = folder / "model.onnx"
    precision = config["ort_precision"]
    if precision == "fp16":
        ox.to_fp16(path, folder / "model.fp16.onnx")
        path = folder / "model.fp16.onnx"
    elif precision.startswith("int8"):
        state.info["float_bytes"] = path.stat().st_size  # the fp32 graph's size, beside the int8 one
        dst = folder / "model.int8.onnx"
        if config.get("int8_fallback", 0) != 0:
            from autotune.compress.fallback import onnx_with_fallback

            fallback = config["int8_fallback"]
            state.info.update(
                onnx_with_fallback(path, dst, precision, fallback, extras.calibration, extras.int8, config)
            )
        else:
            per_channel = bool(config.get("int8_per_channel", False))
            ox.quantize_onnx(path, dst, precision, extras.calibration, per_channel=per_channel)
        path = dst
    module = ox.OrtModule(
        path,
        info["input_names"],
        info["output_names"],
        provider=config["ort_provider"],
        graph_optimization=config["ort_graph_optimization"],
        intra_op_threads=config["num_threads"] or 0,
        io_binding=config["ort_io_binding"] and config["ort_provider"] != "CPUExecutionProvider",
    )
    # ONNX Runtime falls back to the CPU when a provider's libraries do not load, without raising:
    # such a trial would be measured on the CPU under the GPU provider's name.
    state.info["ort_provider_ran"] = module.provider_ran
    if module.provider_ran != module.provider:
        from autotune.errors import TrialError

        raise TrialError(
            "unsupported",
            f"ONNX Runtime ran the session on {module.provider_ran}, not on the {module.provider} it was asked "
            "for (its libraries did not load here; `autotune doctor` shows why)",
        )
    # The graph and session settings that were measured: what the export ships for this winner.
    ort = {"provider": module.provider, "graph_optimization": module.graph_optimization}
    state.artifact = {
        "format": "onnx",
        **info,
        "path": str(path),
        "precision": precision,
        "ort": {**ort, "intra_op_threads": module.intra_op_threads},
    }
    if "int8_kept" in state.info:  # the mixed graph: these layers stay float in the shipped file
        state.artifact["int8_kept"] = list(state.info["int8_kept"])
    from autotune.export.keyed import keyed

    # The model's dict (or ModelOutput) back from the flat outputs, as the user's code reads it.
    return keyed(module, info["output_names"], info.get("output_type")), {**info, "precision": precision}


class _OrtKnob(Knob):
    stage = Stage.COMPILE
    modes = ("inference",)

    def applies(self, config: dict[str, Any]) -> bool:
        return config.get("runtime") == "onnxruntime"

    def apply(self, state: Any, value: Any) -> None:
        pass  # read by ``runtime`` when it builds the ONNX Runtime session


@register
class OrtProvider(_OrtKnob):
    name = "ort_provider"
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
