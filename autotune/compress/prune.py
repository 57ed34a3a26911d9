"""Pruning and the short fine-tuning that recovers accuracy afterwards.

Structured pruning (torch-pruning's dependency graph) gives a smaller dense model, faster
everywhere; unstructured pruning only zeroes weights (a smaller compressed artifact); 2:4
sparsity zeroes two of every four weights, the pattern sparse tensor cores run faster.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch_pruning as tp
from torch import nn
from torch.nn.utils import prune
from torch.utils.flop_counter import FlopCounterMode

from autotune.errors import ConfigError, InputError, TrialError
from autotune.samples import map_tensors, model_inputs, to_device

__all__ = ["count_macs", "output_layers", "prune_structured_", "prune_unstructured_", "prune_2_4_", "finetune_"]

_PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_N_LOSS_MEAN = 10  # steps averaged for loss_first / loss_last: one step's loss is too noisy


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, obj)
    return found


@contextlib.contextmanager
def _traceable(model: nn.Module, grad: bool = True) -> Iterator[None]:
    """Eval mode and the fused attention fast path off; with ``grad``, autograd on for every
    parameter (tracing follows grad_fn links), else no autograd at all.

    The fast path of ``nn.TransformerEncoderLayer``/``nn.MultiheadAttention`` runs one fused
    kernel, so module hooks, the autograd graph and the FLOP counter would not see the layers
    inside. Parameter names (not objects) are remembered because pruning replaces parameters.
    """
    training = {m: m.training for m in model.modules()}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad] if grad else []
    fastpath = torch.backends.mha.get_fastpath_enabled()
    model.eval()
    for name in frozen:
        model.get_parameter(name).requires_grad_(True)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.set_grad_enabled(grad):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for module, mode in training.items():
            module.train(mode)
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)


def _extra_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas torch's counter lacks on the CPU: its fused attention and oneDNN's RNN layer.
    Without them a transformer's attention and a whole LSTM count as zero."""
    from torch.utils.flop_counter import sdpa_flop_count

    aten = torch.ops.aten
    formulas: dict[Any, Any] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        formulas[aten._scaled_dot_product_flash_attention_for_cpu] = lambda q, k, v, *a, out_shape=None, **kw: (
            sdpa_flop_count(q, k, v)
        )
    if hasattr(aten, "mkldnn_rnn_layer"):
        # x: (batch, seq, in) or (seq, batch, in); per step and sample one (in + hidden) x gates product.
        formulas[aten.mkldnn_rnn_layer] = lambda x, w_ih, w_hh, *a, out_shape=None, **kw: (
            2 * x[0] * x[1] * (w_ih[0] * w_ih[1] + w_hh[0] * w_hh[1])
        )
    return formulas


def _measure(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, list[tuple[int, ...]]]:
    counting = FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
    with _traceable(model, grad=False), counting as counter:
        outputs = model(*args, **kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    # FlopCounterMode counts a multiply-add as two FLOPs.
    return counter.get_total_flops() // 2, n_params, [tuple(t.shape) for t in _tensors(outputs)]


def count_macs(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(MACs, parameters) of one forward pass on the example inputs.

    MACs are those of matrix products, convolutions and attention (aten-level, so functional
    code counts too) for the whole example batch; the model's train/eval mode is left as it was.

    Example:
        >>> count_macs(nn.Linear(4, 2), (torch.zeros(3, 4),), {})
        (24, 10)
    """
    macs, n_params, _ = _measure(model, args, kwargs)
    return macs, n_params


def output_layers(model: nn.Module, args: tuple, kwargs: dict) -> list[nn.Module]:
    """The leaf layers whose outputs are (or directly produce) the model's outputs: kept whole by
    pruning, so the output shape never changes.

    Walks the autograd graph back from every output and stops at the first module with its own
    parameters on each path; parameter-free steps (activations, pooling, reshapes, residual
    additions) are walked through.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Softmax(-1))
        >>> output_layers(net, (torch.zeros(1, 4),), {}) == [net[2]]
        True
    """
    producers: dict[Any, nn.Module] = {}

    def record(module: nn.Module, _inputs: Any, output: Any) -> None:
        for t in _tensors(output):
            if t.grad_fn is not None:
                producers[t.grad_fn] = module

    layers = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    hooks = [m.register_forward_hook(record) for m in layers]
    try:
        with _traceable(model):
            outputs = model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    found, seen = set(), set()
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in producers:
            found.add(producers[fn])
        elif fn not in seen:
            seen.add(fn)
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return [m for m in layers if m in found]  # in model order, so the result is deterministic


def _named(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        known = [n for n in modules if n]
        shown = ", ".join(known[:30]) + (f" (and {len(known) - 30} more)" if len(known) > 30 else "")
        raise ConfigError(f"`ignore` names no module {unknown[0]!r} of the model. Known: {shown}.")
    return [modules[n] for n in names]


def _check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise ConfigError(f"The pruning ratio must be a number in [0, 1), but got {ratio!r}.")


def _prune_groups(model: nn.Module, inputs: tuple, ratio: float, keep: list, whole: set) -> None:
    """Prune every coupled group that touches neither ``keep``'s outputs nor any part of ``whole``."""
    with _traceable(model):
        pruner = tp.pruner.BasePruner(
            model,
            inputs,
            importance=tp.importance.GroupMagnitudeImportance(p=2),
            pruning_ratio=ratio,
            ignored_layers=keep,
            # Grouping by head prunes the same dims in every head. num_heads= would do it too,
            # but its head bookkeeping drops the residual-stream group (torch-pruning 1.6), so
            # d_model would never shrink. Fresh dicts: the pruner mutates its shared defaults.
            out_channel_groups={m: m.num_heads for m in model.modules() if isinstance(m, nn.MultiheadAttention)},
            in_channel_groups={},
            num_heads={},
            forward_fn=lambda m, x: m(*x[0], **x[1]),
        )
        for group in pruner.step(interactive=True):
            # ignored_layers only protects a layer's outputs; `ignore` keeps its inputs too.
            if not any(dep.target.module in whole for dep, _ in group):
                group.prune()


def prune_structured_(model: nn.Module, args: tuple, kwargs: dict, ratio: float, ignore: Sequence[str] = ()) -> dict:
    """Remove whole channels, neurons and attention heads with torch-pruning's dependency graph,
    in place, so the result is a smaller dense model.

    Each coupled group (a layer's outputs with every input, norm and residual that must shrink
    with them) loses ``ratio`` of its channels, those of smallest L2 norm. Every head of an
    ``nn.MultiheadAttention`` loses the same dimensions, so heads stay intact.

    Args:
        model: Pruned in place; on an error it may be left half-pruned, so prune a copy.
        args, kwargs: Example inputs on the model's device.
        ratio: Share of channels removed per group, in [0, 1).
        ignore: Module names (as in ``named_modules``) kept whole, besides the output layers.

    Returns:
        ``{"params_before", "params_after", "macs_before", "macs_after"}``.

    Raises:
        ConfigError: ``ratio`` is out of range or ``ignore`` names an unknown module.
        TrialError: kind ``unsupported``: torch-pruning cannot trace or prune this model.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> prune_structured_(net, (torch.randn(2, 8),), {}, 0.5)["params_after"]  # 8 hidden neurons left
        90
    """
    _check_ratio(ratio)
    whole = _named(model, ignore)
    keep = output_layers(model, args, kwargs) + whole
    macs_before, params_before, shapes_before = _measure(model, args, kwargs)
    try:
        _prune_groups(model, (args, kwargs), ratio, keep, {sub for m in whole for sub in m.modules()})
        macs_after, params_after, shapes_after = _measure(model, args, kwargs)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, AssertionError, ValueError, TypeError, IndexError, KeyError) as exc:
        # torch-pruning signals what it cannot handle with asserts and shape errors.
        message = f"torch-pruning could not prune this model: {type(exc).__name__}: {exc}"
        raise TrialError("unsupported", message) from exc
    if shapes_after != shapes_before:
        raise TrialError(
            "unsupported", f"Structured pruning changed the output shapes from {shapes_before} to {shapes_after}."
        )
    return dict(params_before=params_before, params_after=params_after, macs_before=macs_before, macs_after=macs_after)


def _prunable(model: nn.Module, ignore: Sequence[str], types: tuple[type, ...]) -> list[nn.Module]:
    """Layers of ``types`` outside the ignored modules, each weight once (tied weights)."""
    skipped = {sub for m in _named(model, ignore) for sub in m.modules()}
    layers, weights = [], set()
    for m in model.modules():
        if isinstance(m, types) and m not in skipped and m.weight is not None and m.weight not in weights:
            layers.append(m)
            weights.add(m.weight)
    return layers


def prune_unstructured_(model: nn.Module, ratio: float, ignore: Sequence[str] = ()) -> dict:
    """Global magnitude pruning of Linear/Conv weights, made permanent, in place.

    The ``ratio`` smallest-magnitude weights across all those layers become exact zeros; the
    output layers are pruned too unless named in ``ignore``. Parameters and state_dict keys keep
    their names and shapes, so the model only shrinks once compressed.

    Returns:
        ``{"sparsity"}`` (share of zero weights among the pruned layers), ``"params_before"`` and
        ``"params_after"`` (nonzero parameters).

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> prune_unstructured_(net, 0.5)["sparsity"]
        0.5
    """
    _check_ratio(ratio)
    layers = _prunable(model, ignore, _PRUNABLE)
    if not layers:
        raise TrialError("unsupported", "Unstructured pruning found no Linear or Conv layer outside `ignore`.")
    params_before = sum(p.numel() for p in model.parameters())
    orders = [list(m._parameters) for m in layers]
    prune.global_unstructured([(m, "weight") for m in layers], pruning_method=prune.L1Unstructured, amount=ratio)
    for m, order in zip(layers, orders, strict=True):
        prune.remove(m, "weight")  # weight_orig * weight_mask becomes the plain weight again
        # remove() re-registers weight last; restore the order so state_dict reads as before.
        for name in order:
            m._parameters[name] = m._parameters.pop(name)
    n_zero = sum(int((m.weight == 0).sum()) for m in layers)
    n_weights = sum(m.weight.numel() for m in layers)
    params_after = sum(int(p.count_nonzero()) for p in model.parameters())
    return {"sparsity": n_zero / n_weights, "params_before": params_before, "params_after": params_after}


def _mask_2_4(weight: torch.Tensor) -> torch.Tensor:
    """Keep the two largest-magnitude weights of every four consecutive inputs."""
    groups = weight.detach().abs().reshape(-1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(2, dim=1).indices, True)
    return keep.reshape(weight.shape)


def prune_2_4_(model: nn.Module, ignore: Sequence[str] = ()) -> dict:
    """2:4 semi-structured sparsity for Linear layers on CUDA, in place.

    Two of every four weights (by magnitude) become zero and the weight becomes a
    ``torch.sparse`` semi-structured tensor that sparse tensor cores multiply. Layers whose
    shape or dtype the kernels reject stay dense. Attention's fused projections are left alone.

    Returns:
        ``{"n_layers"}``: Linear layers converted.

    Raises:
        TrialError: kind ``unsupported``: the model is not on a CUDA GPU with compute capability
            8.0 or newer, or no Linear layer has a shape the kernels accept.
    """
    fused = nn.modules.linear.NonDynamicallyQuantizableLinear  # MHA's out_proj, read by its fused kernel
    layers = [m for m in _prunable(model, ignore, (nn.Linear,)) if not isinstance(m, fused)]
    if not layers:
        raise TrialError("unsupported", "2:4 sparsity found no Linear layer outside `ignore`.")
    devices = {m.weight.device for m in layers}
    if any(d.type != "cuda" for d in devices):
        raise TrialError(
            "unsupported", f"2:4 sparsity needs Linear layers on a CUDA device, but found {sorted(map(str, devices))}."
        )
    for device in devices:
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise TrialError("unsupported", f"2:4 sparse kernels need compute capability 8.0+, but {device} has less.")
    n_layers = 0
    for m in layers:
        if m.in_features % 4:
            continue
        try:
            sparse = torch.sparse.to_sparse_semi_structured((m.weight.detach() * _mask_2_4(m.weight)).contiguous())
        except RuntimeError:  # a shape or dtype the kernels do not accept: keep the layer dense
            continue
        m.weight = nn.Parameter(sparse, requires_grad=False)
        n_layers += 1
    if n_layers == 0:
        reason = "float16/bfloat16/int8 weights with both dimensions multiples of 16 to 64 (by backend)"
        raise TrialError("unsupported", f"No Linear layer has a weight the 2:4 kernels accept: they need {reason}.")
    return {"n_layers": n_layers}


def _has_zeros(weight: torch.Tensor) -> bool:
    if weight.layout != torch.strided or isinstance(weight, torch.sparse.SparseSemiStructuredTensor):
        return False  # already compressed (2:4): frozen, not trained
    return bool((weight == 0).any())


def _batches(loader: torch.utils.data.DataLoader) -> Iterator[Any]:
    """Batches forever, reshuffled every epoch."""
    while True:
        yield from loader


def finetune_(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    dataset: Any,
    steps: int,
    batch_size: int,
    device: str,
    seed: int = 0,
    lr: float = 1e-3,
) -> dict:
    """Recovery fine-tuning after pruning: ``steps`` Adam steps on shuffled, seeded batches.

    Weights of Linear/Conv layers that are exactly zero stay zero, so the sparsity of unstructured
    pruning survives. Dropout draws from a seeded generator that leaves the global one untouched.
    The model is left in eval mode.

    Args:
        model: Moved to ``device`` and trained in place.
        loss_fn: ``loss_fn(outputs, batch) -> Tensor``, ``batch`` collated and on ``device``.
        dataset: A map-style dataset of samples: tensor, ``(inputs, target)`` or dict.
        steps, batch_size, lr: Adam steps (at least 1), samples per step, learning rate.
        device: Where to train, e.g. ``"cuda"``.
        seed: Seeds the shuffling and dropout.

    Returns:
        ``{"loss_first", "loss_last"}``: mean loss of the first and the last 10 steps.

    Raises:
        ConfigError: ``steps`` or ``batch_size`` is below 1.
        InputError: the dataset is empty.
        TrialError: kind ``nan``: the loss stopped being finite.
    """
    if steps < 1 or batch_size < 1:
        raise ConfigError(f"finetune_ needs steps >= 1 and batch_size >= 1, but got {steps} and {batch_size}.")
    if len(dataset) == 0:
        raise InputError("The fine-tuning dataset is empty: it must hold at least one sample.")
    model.to(device)
    masks = [(m.weight, m.weight != 0) for m in _prunable(model, (), _PRUNABLE) if _has_zeros(m.weight)]
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    generator = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator)
    cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    losses = []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        model.train()
        try:
            for batch in itertools.islice(_batches(loader), steps):
                batch = to_device(batch, torch.device(device))
                args, kwargs = model_inputs(batch)
                loss = loss_fn(model(*args, **kwargs), batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                with torch.no_grad():
                    for weight, mask in masks:
                        weight.mul_(mask)
                losses.append(loss.detach())
        finally:
            model.eval()
    n = min(_N_LOSS_MEAN, len(losses))
    history = torch.stack(losses).float().cpu()  # one device sync, not one per step
    if not bool(history.isfinite().all()):
        step = int((~history.isfinite()).nonzero()[0])
        raise TrialError("nan", f"The fine-tuning loss stopped being finite at step {step}; lower lr.")
    return {"loss_first": float(history[:n].mean()), "loss_last": float(history[-n:].mean())}
