"""Compiles kept out of the clock: every batch shape a loader makes is run once before timing.

``torch.compile`` (static shapes), TorchScript's profiling executor, OpenVINO's CPU plugin and
cuDNN's autotuner do their work per input shape. Token sequences whose padding is trimmed make one shape per batch
size and longest sample, dozens over real sentences. A shape first met inside a timed window
puts a compile (seconds) into it, and a static compile past dynamo's recompile limit
(``torch._dynamo.config.recompile_limit``, 8 by default) stops compiling new shapes: their
batches run eager from then on, as they would in a user's loop.

So before a build is timed, one batch of each shape runs (:func:`shape_batches`); what dynamo
compiled or gave up on is counted (:func:`compile_counts`), so a figure with eager batches is
marked, never presented as the compiled one.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["compile_counts", "compiles_per_shape", "fallback_note", "recompile_limit", "shape_batches", "signature"]


def compile_counts() -> tuple[int, int]:
    """(frames torch.compile compiled, frames it gave up on) in this process so far; a frame
    given up on (past dynamo's recompile limit, say) runs eager. ``(0, 0)`` before it is used.

    Example:
        >>> compiled, fell_back = compile_counts()
        >>> compiled >= 0 and fell_back >= 0
        True
    """
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, 0
    frames = utils.counters["frames"]
    ok = int(frames["ok"])
    return ok, max(0, int(frames["total"]) - ok)


def recompile_limit() -> int:
    """How many graphs dynamo compiles for one function before it runs new shapes eager."""
    import torch._dynamo.config as config

    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def signature(batch: Any) -> tuple[Any, ...]:
    """What a per-shape compile tells batches apart by: each tensor's shape and dtype, in order.

    Example:
        >>> import torch
        >>> signature({"ids": torch.zeros(2, 5, dtype=torch.long)})
        (((2, 5), 'torch.int64'),)
    """
    from autotune.samples import tensor_leaves

    return tuple((tuple(t.shape), str(t.dtype)) for t in tensor_leaves(batch))


def compiles_per_shape(state: Any) -> bool:
    """Whether ``state``'s build does work per input shape on first sight: ``torch.compile``,
    a runtime that declares it (TorchScript; OpenVINO, whose CPU plugin prepares its kernels for
    each new shape of a dynamic model), a knob that declares it (cuDNN's autotuner)."""
    from autotune.knobs import declared
    from autotune.runtimes.base import REGISTRY

    runtime = REGISTRY.get(state.runtime)
    return (
        state.compile_mode != "none"
        or (runtime is not None and runtime.compiles_per_shape)
        or any(state.settings.get(name) for name in declared("per_shape"))
    )


def shape_batches(loader: Any, lengths: Any = None) -> list[Any]:
    """One batch of each distinct shape among ``loader``'s batches, collated on the CPU.

    A padded batch of token sequences has the shape its size and its longest sample set (with
    ``lengths``, each sample's real length); a batch of samples of one shape, the shape its size
    sets (without). So only one batch of each is collated, a few dozen however long the epoch,
    and the model runs once per shape, not once per batch. Samples whose shapes vary otherwise
    (images of many sizes) are not told apart here.

    Args:
        loader: A DataLoader (or a :class:`~autotune.knobs.prefetch.DevicePrefetcher` over one)
            whose ``batch_sampler`` gives each batch's sample indices.
        lengths: Each sample's real length (token sequences), or ``None``.

    Example:
        >>> import torch
        >>> loader = torch.utils.data.DataLoader([torch.zeros(3)] * 10, batch_size=4)
        >>> [tuple(b.shape) for b in shape_batches(loader)]
        [(4, 3), (2, 3)]
    """
    import torch

    inner = getattr(loader, "loader", loader)  # a DevicePrefetcher's DataLoader
    picked: dict[Any, list[int]] = {}
    for ids in inner.batch_sampler:
        ids = list(ids)
        key = (len(ids), max(lengths[i] for i in ids)) if lengths is not None and ids else len(ids)
        picked.setdefault(key, ids)
    few = torch.utils.data.DataLoader(inner.dataset, batch_sampler=list(picked.values()), collate_fn=inner.collate_fn)
    seen: set[Any] = set()
    found = []
    for batch in few:
        mark = signature(batch)
        if mark not in seen:
            seen.add(mark)
            found.append(batch)
    return found


def fallback_note(n_fallbacks: int, n_shapes: int | None = None) -> str:
    """The one line that says a compiled build ran some batches eager."""
    shapes = f" of its {n_shapes} batch shapes" if n_shapes else ""
    return (
        f"torch.compile reached dynamo's recompile limit ({recompile_limit()}){shapes}: batches of further shapes "
        f"ran eager ({n_fallbacks} frame(s) not compiled), and are timed as such; compile_dynamic=True compiles "
        "one graph for every length"
    )
