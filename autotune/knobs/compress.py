"""Compression knobs: ``prune_ratio``, ``prune_method``, ``finetune_steps``, ``quantization``,
``int8_fallback`` and ``int8_per_channel``.

They change the model itself, so the accuracy guard decides whether a candidate may win. The
work is done by :mod:`autotune.compress.prune` (torch-pruning) and :mod:`autotune.compress.quantize`
(PyTorch and torchao int8 paths).
"""

from __future__ import annotations

from typing import Any, ClassVar

from autotune.errors import ConfigError
from autotune.knobs.base import Knob, Offer, SpaceContext, Stage, register
from autotune.runtimes.base import precision_knob


def _extras(state: Any, knob: str) -> Any:
    if state.extras is None or state.extras.example is None:
        raise ConfigError(
            f"The config sets {knob}, which needs example inputs: pass dataset= to autotune.apply "
            "(a few samples are enough)."
        )
    return state.extras


@register
class PruneRatio(Knob):
    name = "prune_ratio"
    reads_inputs = True
    heavy = True
    order = 30
    modes = ("inference",)
    stage = Stage.STRUCTURE
    choices = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7)
    default = 0.0
    help = "Share of channels, neurons and heads (or of weights, for unstructured) removed."

    def validate(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(f"Knob 'prune_ratio' must be a number in [0, 1), but got {value!r}.")
        return float(value)

    def apply(self, state: Any, value: float) -> None:
        state.prune_ratio = value


@register
class PruneMethod(Knob):
    name = "prune_method"
    code = "path"
    held = True
    order = 31
    modes = ("inference",)
    stage = Stage.STRUCTURE
    choices = ("structured", "unstructured", "semi_structured_2_4")
    default = "structured"
    help = (
        "structured: a smaller dense model (torch-pruning); unstructured: zeroed weights, which only "
        "shrink a compressed artifact; semi_structured_2_4: 2:4 sparse kernels on CUDA sm80+."
    )

    def applies(self, config: dict[str, Any]) -> bool:
        return config.get("prune_ratio", 0.0) > 0

    def offer(self, ctx: SpaceContext) -> Offer:
        values, excluded = ["structured"], {}
        if "size" in ctx.objectives:
            values.append("unstructured")
        else:
            excluded["unstructured"] = (
                "zeroed weights only shrink a compressed artifact: offered with the size objective"
            )
        cap = ctx.env.gpu_capability
        if ctx.env.is_cuda and cap is not None and cap >= (8, 0):
            values.append("semi_structured_2_4")
        else:
            excluded["semi_structured_2_4"] = "2:4 sparse kernels need a CUDA GPU with compute capability 8.0+"
        return Offer(values, excluded)

    def apply(self, state: Any, value: str) -> None:
        import autotune.compress.prune as _prune
        from autotune.samples import model_inputs

        if state.prune_ratio <= 0:
            return
        extras = _extras(state, "prune_ratio")
        if value == "structured":
            args, kwargs = model_inputs(extras.example_on(state.device))
            info = _prune.prune_structured_(state.model, args, kwargs, state.prune_ratio, extras.prune_ignore)
        elif value == "unstructured":
            info = _prune.prune_unstructured_(state.model, state.prune_ratio, extras.prune_ignore)
        else:
            info = _prune.prune_2_4_(state.model, extras.prune_ignore)
        state.info.update(info, prune_method=value)


@register
class FinetuneSteps(Knob):
    name = "finetune_steps"
    heavy = True
    order = 32
    modes = ("inference",)
    stage = Stage.STRUCTURE
    choices = (0, 50, 200, 500)
    default = 0
    help = "Recovery fine-tuning steps after pruning (needs loss_fn; uses train_dataset or the dataset)."

    def applies(self, config: dict[str, Any]) -> bool:
        # 2:4 sparse weights are converted to a frozen sparse layout: nothing left to train.
        return config.get("prune_ratio", 0.0) > 0 and config.get("prune_method") != "semi_structured_2_4"

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.has_loss_fn:
            return Offer(list(self.choices))
        return Offer([0], {str(c): "fine-tuning needs loss_fn (in cfg.py or optimize)" for c in self.choices[1:]})

    def apply(self, state: Any, value: int) -> None:
        import autotune.compress.prune as _prune

        if value <= 0 or state.prune_ratio <= 0 or state.info.get("prune_method") == "semi_structured_2_4":
            return
        extras = _extras(state, "finetune_steps")
        if extras.loss_fn is None:
            raise ConfigError("finetune_steps > 0 needs loss_fn(outputs, batch) -> Tensor; pass loss_fn=.")
        info = _prune.finetune_(
            state.model, extras.loss_fn, extras.train_dataset, value, extras.batch_size, state.device, extras.seed
        )
        state.info.update(info)


@register
class Quantization(Knob):
    name = "quantization"
    reads_inputs = True
    code = "path"
    deploy = True
    heavy = True
    order = 41
    modes = ("inference",)
    stage = Stage.WEIGHTS
    choices = ("none", "int8_dynamic", "int8_weight_only", "int8_static")
    default = "none"
    help = (
        "INT8: dynamic (int8 weights, activations quantized on the fly), weight-only, or static "
        "(activations calibrated on dataset batches). Shrinks the model; speed depends on the kernels."
    )

    def applies(self, config: dict[str, Any]) -> bool:
        # ONNX Runtime and OpenVINO quantize their own graphs (ort_precision, ov_precision).
        return precision_knob(config.get("runtime", "torch")) is None

    def offer(self, ctx: SpaceContext) -> Offer:
        import autotune.compress.quantize as _quantize

        values, excluded = ["none"], {}
        for method in self.choices[1:]:
            reason = _quantize.offered(method, ctx.env, ctx.objectives)
            if reason is None and method == "int8_static" and ctx.no_calibration:
                reason = ctx.no_calibration
            if reason is None:
                values.append(method)
            else:
                excluded[method] = reason
        return Offer(values, excluded)

    def apply(self, state: Any, value: str) -> None:
        import autotune.compress.quantize as _quantize

        if value == "none":
            return
        extras = _extras(state, "quantization")
        config = state.config or {}
        fallback, per_channel = config.get("int8_fallback", 0), bool(config.get("int8_per_channel", False))
        float_bytes = _quantize.serialized_bytes(state.model)  # the weights' size before int8, beside it
        on_cuda = state.device.startswith("cuda")
        if on_cuda and (fallback != 0 or per_channel):
            from autotune.errors import TrialError

            raise TrialError(
                "unsupported",
                "int8_per_channel: torchao's CUDA int8 has per-channel weights already"
                if per_channel
                else "int8_fallback ranks torch's int8 layers on the CPU; on CUDA torch int8 quantizes every layer",
            )
        if fallback != 0:
            from autotune.compress.fallback import torch_with_fallback

            state.model, info = torch_with_fallback(
                state.model, value, fallback, extras.calibration, extras.int8, config
            )
            info["method"] = value
        else:
            state.model, info = _quantize.quantize(
                state.model, value, state.device, extras.calibration, example=extras.example, per_channel=per_channel
            )
        state.info.update(info, float_bytes=float_bytes)
        state.quantization = value


_INT8_ORT = ("int8_dynamic", "int8_static")


class _Int8Setting(Knob):
    """A setting of the int8 methods named in ``torch_methods`` and ``graph_methods``, read by
    ``quantization`` (torch) and by a runtime's own precision knob (``ort_precision`` for ONNX
    Runtime, ``ov_precision`` for OpenVINO: the keys of ``graph_methods``) when they quantize."""

    modes = ("inference",)
    stage = Stage.WEIGHTS
    torch_methods: tuple[str, ...] = ()
    graph_methods: ClassVar[dict[str, tuple[str, ...]]] = {}

    def applies(self, config: dict[str, Any]) -> bool:
        own = precision_knob(config.get("runtime", "torch"))
        if own is not None:
            return config.get(own) in self.graph_methods.get(own, ())
        return config.get("quantization", "none") in self.torch_methods

    def apply(self, state: Any, value: Any) -> None:
        pass  # read by quantization (torch) and runtime (ONNX Runtime) when they quantize


@register
class Int8Fallback(_Int8Setting):
    name = "int8_fallback"
    code = "variant"
    prices = True
    held = True
    order = 74  # after quantization and ort_precision, whose values decide whether it applies
    torch_methods = ("int8_dynamic", "int8_weight_only", "int8_static")
    graph_methods = {"ort_precision": _INT8_ORT, "ov_precision": ("int8_static",)}
    choices = (0, 1, 2, 4, 8, "auto")
    default = 0
    help = (
        "How many of the layers int8 hurts most stay float, ranked by their measured sensitivity: "
        "a number, or auto (the fewest that keep the guard). For every int8 method, torch's on the CPU, "
        "ONNX Runtime's and OpenVINO's (NNCF)."
    )

    def offer(self, ctx: SpaceContext) -> Offer:
        if ctx.no_calibration:  # the ranking and auto run on calibration batches
            return Offer([0], {str(c): ctx.no_calibration for c in self.choices[1:]})
        n = ctx.n_quantizable
        if n is not None:
            # Keeping every quantizable layer float (or more than there are) quantizes nothing.
            why = f"the model has {n} layer{'s' if n != 1 else ''} int8 can quantize: keeping {{}} float leaves none"
            too_many = [c for c in self.choices if isinstance(c, int) and c > 0 and c >= n]
            return Offer([c for c in self.choices if c not in too_many], {str(c): why.format(c) for c in too_many})
        return Offer(list(self.choices))


@register
class Int8PerChannel(_Int8Setting):
    name = "int8_per_channel"
    code = "variant"
    held = True
    order = 75  # after quantization and ort_precision, whose values decide whether it applies
    torch_methods = ("int8_dynamic",)
    graph_methods = {"ort_precision": ("int8_dynamic",)}
    choices = (False, True)
    default = False
    help = (
        "Dynamic int8 with one weight scale per output channel instead of one per tensor: less error "
        "for layers whose channels differ in range, at a small cost. torch's and ONNX Runtime's int8_dynamic "
        "(the other int8 methods, and torch's on CUDA, always have per-channel weights)."
    )


def int8_method(config: Any) -> tuple[str, str]:
    """Where and how ``config`` sets its weights' precision: ``(runtime, method)``, the runtime
    whose own precision knob applies (OpenVINO's ``ov_precision``) and that knob's value, or
    ``("torch", quantization)``; int8 where the method starts with ``int8``.

    Example:
        >>> int8_method({"runtime": "openvino", "ov_precision": "int8_static"}), int8_method({})
        (('openvino', 'int8_static'), ('torch', 'none'))
    """
    from autotune.knobs.base import REGISTRY

    runtime = config.get("runtime", REGISTRY["runtime"].default)
    own = precision_knob(runtime)
    if own is None:
        return "torch", str(config.get("quantization", REGISTRY["quantization"].default))
    return runtime, str(config.get(own, REGISTRY[own].default))


def is_int8(config: Any) -> bool:
    """Whether ``config`` runs its weights in int8, on torch's side or a runtime's (:func:`int8_method`)."""
    return int8_method(config)[1].startswith("int8")
