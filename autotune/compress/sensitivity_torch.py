"""INT8 sensitivity and fallback for PyTorch's int8: dynamic and weight-only (``nn.Linear``
layers), and static PT2E (``nn.Linear`` and ``nn.Conv2d``), each by :mod:`autotune.compress.quantize`."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from autotune.compress.int8_gain import gain_batches
from autotune.compress.sensitivity import (  # noqa: F401
    _BACKENDS,
    _FLOAT_TYPES,
    _LAYER_OPS,
    _TARGET_KEYS,
    METHODS,
    Deferred,
    Ranking,
    Score,
    _candidates,
    _check_batches,
    _check_float,
    _check_keep,
    _check_ranking,
    _model_inputs,
    _order,
    _outcome,
    _refine,
    _search,
    speed_ratio,
)
from autotune.errors import InputError, TrialError

__all__ = ["fallback_torch", "quantize_torch_except", "rank_torch", "torch_layers"]


# --- PyTorch int8 ------------------------------------------------------------------------------

_TORCH_METHODS = ("int8_dynamic", "int8_weight_only", "int8_static")


def torch_layers(model: nn.Module, method: str = "int8_dynamic") -> list[str]:
    """Names of the modules ``method`` quantizes one by one, in module order: ``nn.Linear``; for
    ``int8_dynamic`` also ``nn.LSTM`` and ``nn.GRU``, for ``int8_static`` also ``nn.Conv2d``.

    Subclasses (``nn.MultiheadAttention``'s ``out_proj``, whose float weight attention reads
    directly) are left out, as ``quantize_dynamic`` with ``{nn.Linear}`` leaves them.

    Example:
        >>> torch_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        ['0', '2']
    """
    if method not in _TORCH_METHODS:
        raise InputError(f"No PyTorch int8 method named {method!r}. Known: {', '.join(_TORCH_METHODS)}.")
    types = {"int8_dynamic": (nn.Linear, nn.LSTM, nn.GRU), "int8_static": (nn.Linear, nn.Conv2d)}.get(
        method, (nn.Linear,)
    )
    return [name for name, m in model.named_modules() if type(m) in types]


def _cpu_outputs(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, Mapping):
        return {k: _cpu_outputs(v) for k, v in out.items()}
    if isinstance(out, tuple | list):
        return [_cpu_outputs(v) for v in out]
    return out


def _torch_outputs(model: nn.Module, batches: list, what: str) -> list:
    outs = []
    with torch.inference_mode():
        for i, batch in enumerate(batches):
            args, kwargs = _model_inputs(batch)
            try:
                outs.append(_cpu_outputs(model(*args, **kwargs)))
            except Exception as exc:
                text = " ".join(str(exc).split())[:300]
                raise InputError(f"{what} fails on calibration batch {i}: {type(exc).__name__}: {text}") from exc
    return outs


def _nothing(method: str, model: nn.Module) -> TrialError:
    what = {"int8_dynamic": "nn.Linear, nn.LSTM or nn.GRU", "int8_static": "nn.Linear or nn.Conv2d"}.get(
        method, "nn.Linear"
    )
    return TrialError("unsupported", f"{method} found no {what} to quantize in {type(model).__name__}.")


def _check_torch(model: nn.Module, batches: list, method: str) -> list[str]:
    _check_batches(batches)
    if method != "int8_weight_only" and torch.backends.quantized.supported_engines == ["none"]:
        raise TrialError("unsupported", "This torch build has no quantized CPU engine (fbgemm, onednn or qnnpack).")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise InputError("PyTorch int8 fallback runs on the CPU; move the model there first (model.cpu()).")
    if model.training:
        raise InputError("The model is in training mode; call model.eval() so dropout does not blur the ranking.")
    layers = torch_layers(model, method)
    if not layers:
        raise _nothing(method, model)
    return layers


def _int8_copy(model: nn.Module, names: set[str], method: str, per_channel: bool, batches: list) -> nn.Module:
    """A copy of ``model`` with the layers in ``names`` in ``method``'s int8, the rest float."""
    from autotune.compress.quantize import quantize

    quantized, _ = quantize(
        copy.deepcopy(model), method, "cpu", batches, example=batches[0] if batches else None,
        layers=names, per_channel=per_channel,
    )  # fmt: skip
    return quantized


def quantize_torch_except(
    model: nn.Module,
    keep_float: Iterable[str],
    method: str = "int8_dynamic",
    *,
    calibration: list | None = None,
    per_channel: bool = False,
) -> nn.Module:
    """A copy of ``model`` with every layer ``method`` takes in int8 except ``keep_float``.

    The model itself is left as it is. A dynamic int8 model holding transformer layers comes
    back wrapped so that it runs with PyTorch's fused fast path off (it reads float weights);
    a static one is a ``GraphModule``.

    Args:
        model: A float model on the CPU, in eval mode.
        keep_float: Layer names (from :func:`torch_layers`) to leave float.
        method: ``"int8_dynamic"``, ``"int8_weight_only"`` or ``"int8_static"``.
        calibration: Batches; ``int8_static`` needs them (it observes activation ranges on
            them and exports with the first).
        per_channel: ``int8_dynamic`` with per-channel weights.

    Raises:
        InputError: an unknown name in ``keep_float``, all layers in it, or ``int8_static``
            without calibration batches.
        TrialError: kind ``unsupported``: no layer to quantize, or torch failed.

    Example:
        >>> q = quantize_torch_except(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval(), ["1"])
        >>> [m._get_name() for m in q]
        ['DynamicQuantizedLinear', 'Linear']
    """
    layers = torch_layers(model, method)
    if not layers:
        raise _nothing(method, model)
    if method == "int8_static" and not calibration:
        raise InputError("int8_static needs calibration batches to observe activation ranges, but got none.")
    keep = _check_keep(keep_float, layers)
    from autotune.compress.quantize import quantize

    batches = list(calibration or [])
    quantized, _ = quantize(
        copy.deepcopy(model), method, "cpu", batches, example=batches[0] if batches else None,
        keep_float=keep, per_channel=per_channel,
    )  # fmt: skip
    return quantized


def _stream(model: nn.Module, layers: list[str], batches: list, on_call: Callable, deadline: float | None) -> int:
    """Run the float model on ``batches`` calling ``on_call(name, module, args, kwargs, output)``
    at each call of each layer, as it happens: nothing is kept, so at most the layer being
    called holds activations. Stops after the batch that passes ``deadline`` (at least one runs).

    Returns:
        The number of batches run.
    """
    modules = dict(model.named_modules())
    busy = []  # on_call may run the layer itself (functional_call): its own call is not a layer call

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if not busy:
                busy.append(name)
                try:
                    on_call(name, module, args, kwargs, out)
                finally:
                    busy.pop()

        return hook

    hooks = [modules[name].register_forward_hook(hook_for(name), with_kwargs=True) for name in layers]
    try:
        for i, batch in enumerate(batches):
            _torch_outputs(model, [batch], "The float model")
            if deadline is not None and time.perf_counter() >= deadline:
                return i + 1
    finally:
        for hook in hooks:
            hook.remove()
    return len(batches)


def _main(out: Any) -> torch.Tensor:
    """A layer's main output: the tensor itself, or an RNN's output sequence (not its state)."""
    while isinstance(out, tuple | list):
        out = out[0]
    return out


def _fake_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` in symmetric int8 with one scale per output channel (dim 0), dequantized."""
    scale = w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True).clamp_min(1e-12) / 127
    return torch.clamp(torch.round(w / scale), -127, 127) * scale


def _fake_activation(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """``x`` in uint8 on the range [lo, hi] widened to hold 0, dequantized."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / 255 if hi > lo else 1.0
    zero = round(-lo / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


def _emulated(module: nn.Module, method: str, lo: float = 0.0, hi: float = 0.0) -> Callable[..., torch.Tensor]:
    """``module`` (a Linear or Conv2d) as int8 would compute it (weights symmetric per channel;
    for ``int8_static`` its input uint8 on [lo, hi], its range over the batches), in float arithmetic."""
    from torch.func import functional_call

    params = {**dict(module.named_parameters()), "weight": _fake_weight(module.weight.detach())}

    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = _fake_activation(x, lo, hi) if method == "int8_static" else x
        return functional_call(module, params, (x, *args), kwargs)

    return run


class _One(nn.Module):
    """One layer alone, called with whatever arguments the model called it with."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer(*args, **kwargs)


def _single(module: nn.Module, method: str, per_channel: bool, bounds: tuple[float, float] | None) -> Callable:
    """``module`` alone in int8: torch's dynamic int8 kernel, or the others emulated."""
    from autotune.compress.quantize import quantize

    if method != "int8_dynamic":
        return _emulated(module, method, *(bounds or (0.0, 0.0)))
    single, _ = quantize(
        _One(copy.deepcopy(module)), method, "cpu", [], example=None, layers={"layer"}, per_channel=per_channel
    )
    return single


def _cheap_torch(
    model: nn.Module, layers: list[str], batches: list, method: str, per_channel: bool, deadline: float | None = None
) -> tuple[dict[str, float], set[str], int]:
    """Each layer's relative output error when it alone goes int8 on its own inputs, streamed:
    each call of a layer is compared as it happens, then dropped (see :func:`_stream`). Through
    torch's dynamic int8 kernel for ``int8_dynamic``; emulated for the others (weights symmetric
    per channel; ``int8_static`` activations uint8 on their range over the batches, taken by a
    first pass that keeps two numbers per layer).

    Returns:
        ``(errors, layers never called, batches used)``.
    """
    modules = dict(model.named_modules())
    bounds: dict[str, tuple[float, float]] = {}
    if method == "int8_static":

        def observe(name: str, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            lo, hi = bounds.get(name, (math.inf, -math.inf))
            bounds[name] = (min(lo, float(args[0].min())), max(hi, float(args[0].max())))

        batches = batches[: _stream(model, layers, batches, observe, deadline)]
    # Built before the hooks are on: a copy of a hooked module would carry the hook.
    singles = {name: _single(modules[name], method, per_channel, bounds.get(name)) for name in layers}
    sums = {name: [0.0, 0.0] for name in layers}
    called: set[str] = set()

    def compare(name: str, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        y, y_q = _main(out).double(), _main(singles[name](*args, **kwargs)).double()
        sums[name][0] += float(torch.sum((y_q - y) ** 2))
        sums[name][1] += float(torch.sum(y**2))
        called.add(name)

    used = _stream(model, layers, batches, compare, deadline)
    errors = {}
    for name, (num, den) in sums.items():  # never called: int8 cannot change the outputs through it
        errors[name] = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return errors, set(layers) - called, used


def rank_torch(
    model: nn.Module,
    batches: list,
    score: Score,
    *,
    budget_s: float | None = None,
    refine: bool | int = True,
    method: str = "int8_dynamic",
    per_channel: bool = False,
) -> Ranking:
    """Rank a model's quantizable layers by how much PyTorch's ``method`` int8 hurts each alone.

    Cheap pass: forward hooks run each layer, quantized alone, on its inputs as the float model
    calls it, one call at a time (:func:`_cheap_torch`), batch by batch until ``budget_s``. Exact
    pass: the top layers are quantized one at a time in a copy of the model and scored with
    ``score``, while the budget lasts.

    Args:
        model: A float model on the CPU, in eval mode; it is not changed.
        batches: Collated batches (a tensor, ``(inputs, target)``, or a dict of keyword inputs);
            ``int8_static`` also calibrates on them.
        score: ``score(reference_outputs, candidate_outputs) -> float``, higher is better.
        budget_s: Seconds the ranking may take: the cheap pass stops after the batch that
            passes it (at least one), and no layer is refined after it.
        refine: ``True``, an int, or ``False``, as in :func:`rank_onnx`.
        method: ``"int8_dynamic"``, ``"int8_weight_only"`` or ``"int8_static"``.
        per_channel: ``int8_dynamic`` with per-channel weights.

    Raises:
        InputError: no batches, a model off the CPU or in training mode, or it fails on a batch.
        TrialError: kind ``unsupported``: no layer to quantize, or torch failed to quantize one.

    Example:
        >>> ranking = rank_torch(model.eval(), batches, worst_cosine)  # doctest: +SKIP
    """
    start = time.perf_counter()
    layers = _check_torch(model, batches, method)
    reference = _torch_outputs(model, batches, "The float model")
    deadline = None if budget_s is None else start + budget_s
    cheap, uncalled, used = _cheap_torch(model, layers, batches, method, per_channel, deadline)

    def measure(name: str) -> float:
        single = _int8_copy(model, {name}, method, per_channel, batches)
        return score(reference, _torch_outputs(single, batches, "The int8 model"))

    called = {name: error for name, error in cheap.items() if name not in uncalled}
    exact = _refine(_candidates(called, refine), measure, budget_s, start)
    return Ranking(method, "torch", _order(cheap, exact), cheap, exact, time.perf_counter() - start, used)


def fallback_torch(
    model: nn.Module,
    ranking: Ranking | Deferred,
    batches: list,
    score: Score,
    threshold: float,
    *,
    k: int | str = "auto",
    per_channel: bool = False,
    budget_s: float | None = None,
    floor: int = 0,
    check_gain: bool = False,
) -> tuple[nn.Module | None, dict[str, Any]]:
    """An int8 copy of ``model`` (``ranking``'s method) with its ``k`` most sensitive layers float.

    ``k="auto"`` finds the fewest kept float that pass, as :func:`fallback_onnx` does.

    Returns:
        The mixed model (``None`` when only the float model passes, k = n) and ``{"kept", "k",
        "score", "n_layers", "threshold", "feasible", "reason", "tries"}``.

    Raises:
        InputError: the ranking is for another model, or the float model scores below ``threshold``.
        TrialError: kind ``unsupported``: torch failed to quantize.

    Example:
        >>> q, info = fallback_torch(model, ranking, batches, worst_cosine, 0.99)  # doctest: +SKIP
    """
    method = ranking.method
    layers = _check_torch(model, batches, method)
    _check_ranking(ranking, "torch", method, layers)
    reference = _torch_outputs(model, batches, "The float model")
    _check_float(score, reference, threshold)

    def mixed(keep: list[str]) -> nn.Module:
        return quantize_torch_except(model, keep, method, calibration=batches, per_channel=per_channel)

    whole: list[nn.Module] = []  # the whole-int8 copy, until gain() times it (then dropped)

    def try_k(j: int) -> float:
        candidate = mixed(ranking.top(j))
        if j == 0 and check_gain:
            whole.append(candidate)
        return score(reference, _torch_outputs(candidate, batches, "The int8 model"))

    def gain() -> float:
        int8 = whole.pop() if whole else mixed([])
        timed = gain_batches(batches)
        return speed_ratio(lambda: _torch_outputs(model, timed, "The float model"),
                           lambda: _torch_outputs(int8, timed, "The int8 model"))  # fmt: skip

    deadline = None if budget_s is None else time.perf_counter() + budget_s
    found = _search(len(layers), k, threshold, try_k, deadline, floor, gain=gain if check_gain else None)
    whole.clear()  # k = 0 passed and gain() was never asked: not kept past the search
    result = _outcome(found, layers, ranking, threshold)
    # Quantized again rather than kept from the search: one copy of the model alive at a time.
    chosen = mixed(result["kept"]) if result["k"] < len(layers) else None
    return chosen, result
