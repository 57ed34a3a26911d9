"""INT8 sensitivity and fallback for PyTorch's dynamic int8 (``nn.Linear`` layers)."""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from autotune.compress.sensitivity import (  # noqa: F401
    _BACKENDS,
    _FLOAT_TYPES,
    _LAYER_OPS,
    _TARGET_KEYS,
    METHODS,
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
)
from autotune.errors import InputError, TrialError

__all__ = ["fallback_torch", "quantize_torch_except", "rank_torch", "torch_layers"]


# --- PyTorch dynamic int8 ---------------------------------------------------------------------


def torch_layers(model: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules PyTorch's dynamic int8 quantizes, in module order.

    Subclasses (``nn.MultiheadAttention``'s ``out_proj``, whose float weight attention reads
    directly) are left out, as ``quantize_dynamic`` with ``{nn.Linear}`` leaves them.

    Example:
        >>> torch_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        ['0', '2']
    """
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


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


def _dynamic_int8(model: nn.Module, names: set[str]) -> nn.Module:
    """``model`` itself with the Linear modules in ``names`` swapped for dynamic int8 ones."""
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, whose CPU int8 Linear is
        # slower eagerly; autotune._quantize keeps the old path for the same reason.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        try:
            return torch.ao.quantization.quantize_dynamic(model, set(names), dtype=torch.qint8, inplace=True)
        except Exception as exc:
            text = " ".join(str(exc).split())[:300]
            raise TrialError(
                "unsupported", f"Dynamic int8 (torch.ao.quantization) failed: {type(exc).__name__}: {text}"
            ) from exc


def _check_torch(model: nn.Module, batches: list) -> list[str]:
    _check_batches(batches)
    if torch.backends.quantized.supported_engines == ["none"]:
        raise TrialError("unsupported", "This torch build has no quantized CPU engine (fbgemm, onednn or qnnpack).")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise InputError("PyTorch dynamic int8 runs on the CPU; move the model there first (model.cpu()).")
    if model.training:
        raise InputError("The model is in training mode; call model.eval() so dropout does not blur the ranking.")
    layers = torch_layers(model)
    if not layers:
        raise TrialError("unsupported", f"int8_dynamic found no nn.Linear to quantize in {type(model).__name__}.")
    return layers


def quantize_torch_except(model: nn.Module, keep_float: Iterable[str]) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` in dynamic int8 except ``keep_float``.

    The model itself is left as it is. A model holding transformer layers comes back wrapped so
    that it runs with PyTorch's fused fast path off (it reads float weights).

    Raises:
        InputError: an unknown name in ``keep_float``, or all layers in it.
        TrialError: kind ``unsupported``: no ``nn.Linear``, or torch failed.

    Example:
        >>> q = quantize_torch_except(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval(), ["1"])
        >>> [m._get_name() for m in q]
        ['DynamicQuantizedLinear', 'Linear']
    """
    layers = torch_layers(model)
    if not layers:
        raise TrialError("unsupported", f"int8_dynamic found no nn.Linear to quantize in {type(model).__name__}.")
    keep = set(_check_keep(keep_float, layers))
    return _int8_copy(model, {n for n in layers if n not in keep})


def _int8_copy(model: nn.Module, names: set[str]) -> nn.Module:
    quantized = _dynamic_int8(copy.deepcopy(model), names)
    if any(isinstance(m, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer) for m in quantized.modules()):
        # Their fused fast path reads float weights that quantized Linears do not have.
        from autotune.compress.quantize import WithoutFastPath

        quantized = WithoutFastPath(quantized)
    return quantized


def _cheap_torch(model: nn.Module, layers: list[str], batches: list) -> dict[str, float]:
    """Each Linear's relative output error when its own input and weights go through torch's
    dynamic int8 kernel (activations per tensor on each batch's range, weights per tensor)."""
    modules = dict(model.named_modules())
    seen: dict[str, list] = {name: [] for name in layers}

    def keep(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
            seen[name].append((args[0] if args else kwargs["input"], out))

        return hook

    hooks = [modules[name].register_forward_hook(keep(name), with_kwargs=True) for name in layers]
    try:
        _torch_outputs(model, batches, "The float model")
    finally:
        for hook in hooks:
            hook.remove()
    errors = {}
    with torch.inference_mode():
        for name in layers:
            single = _dynamic_int8(nn.Sequential(copy.deepcopy(modules[name])), {"0"})
            num = den = 0.0
            for x, y in seen.pop(name):
                num += float(torch.sum((single(x).double() - y.double()) ** 2))
                den += float(torch.sum(y.double() ** 2))
            errors[name] = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return errors


def rank_torch(
    model: nn.Module,
    batches: list,
    score: Score,
    *,
    budget_s: float | None = None,
    refine: bool | int = True,
) -> Ranking:
    """Rank a model's ``nn.Linear`` layers by how much PyTorch's dynamic int8 hurts each alone.

    Cheap pass: forward hooks capture every Linear's input and output on the batches; each
    Linear, quantized alone, runs on its captured inputs. Exact pass: the top layers are
    quantized one at a time in a copy of the model and scored with ``score``, until ``budget_s``.

    Args:
        model: A float model on the CPU, in eval mode; it is not changed.
        batches: Collated batches (a tensor, ``(inputs, target)``, or a dict of keyword inputs).
        score: ``score(reference_outputs, candidate_outputs) -> float``, higher is better.
        budget_s: Seconds after which no further layer is refined.
        refine: ``True``, an int, or ``False``, as in :func:`rank_onnx`.

    Raises:
        InputError: no batches, a model off the CPU or in training mode, or it fails on a batch.
        TrialError: kind ``unsupported``: no ``nn.Linear``, or torch failed to quantize one.

    Example:
        >>> ranking = rank_torch(model.eval(), batches, worst_cosine)  # doctest: +SKIP
    """
    start = time.perf_counter()
    layers = _check_torch(model, batches)
    reference = _torch_outputs(model, batches, "The float model")
    cheap = _cheap_torch(model, layers, batches)

    def measure(name: str) -> float:
        single = _int8_copy(model, {name})
        return score(reference, _torch_outputs(single, batches, "The int8 model"))

    exact = _refine(_candidates(cheap, refine), measure, budget_s, start)
    return Ranking(
        "int8_dynamic", "torch", _order(cheap, exact), cheap, exact, time.perf_counter() - start, len(batches)
    )


def fallback_torch(
    model: nn.Module,
    ranking: Ranking,
    batches: list,
    score: Score,
    threshold: float,
    *,
    k: int | str = "auto",
) -> tuple[nn.Module | None, dict[str, Any]]:
    """A dynamic int8 copy of ``model`` with its ``k`` most sensitive Linears float.

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
    layers = _check_torch(model, batches)
    _check_ranking(ranking, "torch", "int8_dynamic", layers)
    reference = _torch_outputs(model, batches, "The float model")
    _check_float(score, reference, threshold)

    def try_k(j: int) -> float:
        return score(reference, _torch_outputs(quantize_torch_except(model, ranking.top(j)), batches, "The int8 model"))

    result = _outcome(_search(len(layers), k, threshold, try_k), layers, ranking, threshold)
    # Quantized again rather than kept from the search: one copy of the model alive at a time.
    chosen = quantize_torch_except(model, result["kept"]) if result["k"] < len(layers) else None
    return chosen, result
