"""The levers of the staged strategy (:mod:`autotune.search.strategy`): each idea an engineer
would try (autocast, trimmed padding with length grouping, ``torch.compile``, int8, a larger
batch, the data path on CUDA, ...), with its values in order of promise, as the space offers them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autotune.knobs import REGISTRY
from autotune.search.space import SearchSpace

# On CUDA the data path to the device is tuned like the model, ahead of compile: one index
# operation per batch for tensor-backed data, pinned memory with the next batch copied on a side
# stream, workers kept alive with batches prefetched. A ResNet-50 fed per-sample collated batches
# from pageable memory sat at 3,000 img/s on an H100 for every model recipe (bf16, compile).
FEED = ("device_resident", "gather", "pin_memory", "num_workers")


def fed(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` takes the data path's levers (:data:`FEED`'s, the feeder's, the
    prefetcher's): the feed was worked on, so an input bound left is the host thread's."""
    keys = ("feed_ahead", "device_resident", "device_prefetch", "num_workers")
    return config.get("gather") == "batched" or any(config.get(k) for k in keys)


# Loader workers on CUDA: as many as this, within the usable CPUs (the expert recipe's 8).
CUDA_WORKERS = 8
# The compile modes but the default ones, in the order a space offering none of those screens them:
# CUDA graphs first (a small model's launches), then the autotuned kernels.
COMPILE_MODES = ("reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


@dataclasses.dataclass(frozen=True)
class Lever:
    """One idea to screen: its name and its values in order of promise, each a dict of changes
    to the baseline (only the knobs the lever sets)."""

    name: str
    variants: tuple[Mapping[str, Any], ...]


def _first(space: SearchSpace, name: str, preferred: Sequence[Any]) -> Any:
    values, base = space.values.get(name, ()), space.baseline.get(name)
    return next((v for v in preferred if v in values and v != base), None)


def _nearest(values: Sequence[Any], target: float) -> Any:
    return min(values, key=lambda v: (abs(math.log(v / target)), v)) if values else None


def _variants(space: SearchSpace, *options: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Each option maps knobs to preferred values; an option with a knob the space does not
    offer is left out."""
    found = []
    for option in options:
        changes = {k: _first(space, k, prefs) for k, prefs in option.items()}
        if all(v is not None for v in changes.values()) and changes:
            found.append(changes)
    return found


def _openvino(space: SearchSpace, shape: list[dict[str, Any]], auto: dict[str, Any]) -> tuple[list, list]:
    """OpenVINO's variants: float32 then bfloat16 (offered only with bf16 units), and its int8
    (for the int8 lever), each on the trimmed, grouped batches where the data has them: OpenVINO
    runs any length without recompiling, which is where it pays (a hand export on trimmed, sorted
    MiniLM batches: 3.07x; untrimmed far less), and it cannot join a recipe holding autocast,
    which it replaces."""
    ov = {"runtime": ("openvino",)}
    on_shape = dict(shape[0]) if shape else {}
    floats = _variants(space, ov, {**ov, "ov_precision": ("bf16",)})
    int8 = _variants(space, {**ov, "ov_precision": ("int8_static",), **auto})
    return [{**v, **on_shape} for v in floats], [{**v, **on_shape} for v in int8]


def _feed(space: SearchSpace, workers: list[int], cores: int, add: Callable[[str, list[dict[str, Any]]], None]) -> None:
    """Add the data path's levers on CUDA (:data:`FEED`) with ``add``."""
    # The samples kept on the device, where they fit and are read again: no batch crosses the
    # bus, nothing waits for the host but the launches (fed from a thread of their own first).
    resident = {"device_resident": (True,)}
    add("device_resident", _variants(space, {**resident, "feed_ahead": (2, 4)}, resident))
    add("gather", _variants(space, {"gather": ("batched",)}))
    # Pinned batches copied on a side stream, made on the feeder thread (the host's gather or
    # collate, pin and copy launch off the model's thread), else on the model's.
    prefetch = {"pin_memory": (True,), "device_prefetch": (True,)}
    add("pin_memory", _variants(space, {**prefetch, "feed_ahead": (2, 4)}, prefetch, {"pin_memory": (True,)}))
    if workers and space.baseline.get("num_workers") == 0:
        n = _nearest(workers, min(CUDA_WORKERS, cores))
        kept = {"num_workers": (n,), "persistent_workers": (True,), "prefetch_factor": (4, 8)}
        add("num_workers", _variants(space, kept, {"num_workers": (n,), "persistent_workers": (True,)}) or
            [{"num_workers": n}])  # fmt: skip


def _cpu_workers(space: SearchSpace, workers: list[int], cores: int, add: Callable[..., None]) -> None:
    """Add the loader workers' lever on a CPU with ``add``: workers beside the threads they leave
    free (a perf guide's recipe: workers plus threads = cores), then beside the baseline's threads."""
    if workers and space.baseline.get("num_workers") == 0:
        n = _nearest(workers, min(2, cores))
        free = _variants(space, {"num_workers": (n,), "num_threads": (max(1, cores - n),)})
        add("num_workers", [*free, {"num_workers": n}])


def _ranks(space: SearchSpace, cuda: bool, add: Callable[..., None]) -> None:
    """Add training in several ranks (torchrun, DDP) with ``add``: every GPU, or on a CPU two ranks
    each on half the cores; a launch of its processes (seconds), tried once. Each rank takes 1/w of
    a step's samples, so the baseline's micro-batch is split w ways (it divides the rank's share
    whenever it divided the effective batch; the whole micro-batch would not, where it was the
    effective batch)."""
    ranks = [w for w in space.values.get("world_size", ()) if w > 1]
    if ranks:
        w, base = ranks[-1] if cuda else ranks[0], space.baseline["batch_size"]
        split = base // w if base // w in space.values.get("batch_size", ()) else None
        add("world_size", [{"world_size": w} if split is None else {"world_size": w, "batch_size": split}])


def _trims(space: SearchSpace, shape: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The padding lever's variants: trimmed padding with length grouping (``shape``), else alone."""
    trims = shape or _variants(space, {"padding": ("trim", "trim_8", "trim_16")})
    if "none" not in space.values.get("compile_mode", ("none",)):
        # A compile fixed on for every trial (fix={"compile_mode": ...}): trimmed padding goes with
        # shapes as symbols, or each width compiles anew until dynamo's recompile limit (80 s of a
        # 100-s trial of real MiniLM text on 2 cores), and the widths after it run eager.
        symbols = _variants(space, {"compile_dynamic": (True,)})
        trims = [{**t, **s} for t in trims for s in symbols] or trims
    return trims


def _builds(space: SearchSpace, shape: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The compile lever's variants and a TorchScript trace's, each a build of its own."""
    # Token sequences of many lengths whose padding the space may trim: a static compile makes
    # one graph per width and past dynamo's recompile limit (8) runs the others eager, inside
    # the trial's windows (real MiniLM text: "size mismatch at index 1, expected 28, actual 18").
    # Shapes as symbols come first.
    dynamic = _variants(space, {"compile_mode": ("default",), "compile_dynamic": (True,)}) if shape else []
    # Where the space offers neither default mode (a user's space of "none" and "reduce-overhead"),
    # the compile is screened in the mode it offers: on an H200 such a space never compiled at all,
    # the CUDA-graph move waiting for a launch-bound best that the model alone did not report.
    modes = _variants(space, {"compile_mode": ("default",)}, {"compile_mode": ("default-freezing",)})
    modes = modes or _variants(space, {"compile_mode": COMPILE_MODES})
    found = [("compile_mode", [*dynamic, *modes])]
    # A frozen TorchScript trace, where the space offers it (the gpu and cpu-deploy presets): a
    # build like a compile's, tried once on the best cheap composition; refinement alone seldom
    # sampled it (a 3-trial study of runtimes torch, torchscript and onnxruntime never did).
    return [*found, ("torchscript", _variants(space, {"runtime": ("torchscript",)}))]


# Where each lever written here is screened among all (lower first); a knob with a lever of its
# own declares its rank (``screen_rank``, :class:`autotune.knobs.Knob`): JPEG drafts 30, autocast
# 40, the decoded cache 100, channels-last 120, the optimizer 130, cuDNN's benchmark 140, TF32
# 150, flushed denormals 160.
RANKS = {"padding": 10, "image_shape": 20, "workers_decoding": 35, "openvino": 50, "feed": 55, "int8": 60,
         "compile_mode": 70, "torchscript": 75, "batch_size": 80, "num_threads": 90, "workers": 105,
         "world_size": 110}  # fmt: skip


def _own(space: SearchSpace) -> list[tuple[int, Lever]]:
    """The levers the knobs declare for themselves (``screen``), with their ranks."""
    found = []
    for name, knob in REGISTRY.items():
        options = [v if isinstance(v, Mapping) else {name: (v,)} for v in knob.screen]
        variants = _variants(space, *options)
        if variants:
            found.append((knob.screen_rank, Lever(name, tuple(variants))))
    return found


def levers(space: SearchSpace, cores: int | None = None, device: str = "cpu") -> list[Lever]:
    """The levers the space offers, in order of promise (the order they are screened in): those
    written here (:data:`RANKS`) and those the knobs declare (:func:`_own`).

    Only values the space offers are used, so what the Env rules out (bfloat16 without
    AVX-512 or AMX, int8 without a quantizable layer, compile without a compiler, padding on
    data that is not token sequences) is never screened. On CUDA the data path's levers
    (:data:`FEED`) come before int8 and compile.

    Args:
        space: The resolved search space.
        cores: Usable CPUs, for the thread and loader-worker levers (default: the baseline's threads).
        device: ``"cpu"`` or ``"cuda..."``.
    """
    base = space.baseline
    cores = cores or base.get("num_threads") or 1
    found = _own(space)

    def at(rank: int) -> Callable[[str, list[dict[str, Any]]], None]:
        def add(name: str, variants: list[dict[str, Any]]) -> None:
            if variants:
                found.append((rank, Lever(name, tuple(variants))))

        return add

    shape = _variants(space, {"padding": ("trim", "trim_8", "trim_16"), "length_grouping": (16, 4, 64)})
    at(RANKS["padding"])("padding", _trims(space, shape))
    # Images of many sizes: padded to fewer shapes and batched with their like (grouping alone
    # behind the user's own collate, which does the padding).
    image = _variants(space, {"image_padding": ("largest_32", "largest_16"), "size_grouping": (16, 4, 64)})
    at(RANKS["image_shape"])("image_shape", image or _variants(space, {"size_grouping": (16, 4, 64)}))
    workers = [n for n in space.values.get("num_workers", ()) if n and n > 0]
    cuda = device.startswith("cuda")
    # Photos decoded in __getitem__ (the JPEG drafts' lever offered): loader workers right after
    # it on a CPU, the other half of a decode-bound pipeline's cure (see screen).
    decoding = any(lever.name == "jpeg_draft" for _, lever in found)
    if decoding and not cuda:
        _cpu_workers(space, workers, cores, at(RANKS["workers_decoding"]))
    auto = {"int8_fallback": ("auto",)} if "auto" in space.values.get("int8_fallback", ()) else {}
    ov_float, ov_int8 = _openvino(space, shape, auto)
    at(RANKS["openvino"])("openvino", ov_float)
    if cuda:
        _feed(space, workers, cores, at(RANKS["feed"]))
    ort = {"runtime": ("onnxruntime",), "ort_precision": ("int8_dynamic",)}
    int8 = _variants(space, {**ort, **auto}, {"quantization": ("int8_dynamic",), **auto}, {"runtime": ("onnxruntime",)})
    at(RANKS["int8"])("int8", ov_int8 + int8)
    for name, variants in _builds(space, shape):
        at(RANKS[name])(name, variants)
    larger = [b for b in space.values.get("batch_size", ()) if b > base["batch_size"]]
    if larger:
        at(RANKS["batch_size"])("batch_size", [{"batch_size": _nearest(larger, 4 * base["batch_size"])}])
    fewer = [n for n in space.values.get("num_threads", ()) if n is not None and n < (base.get("num_threads") or 0)]
    if fewer:
        at(RANKS["num_threads"])("num_threads", [{"num_threads": _nearest(fewer, max(1.0, cores / 2))}])
    if not cuda and not decoding:
        _cpu_workers(space, workers, cores, at(RANKS["workers"]))
    _ranks(space, cuda, at(RANKS["world_size"]))
    return [lever for _, lever in sorted(found, key=lambda ranked: ranked[0])]


def size_levers(space: SearchSpace) -> list[Lever]:
    """With size the first objective: int8, then the pruning ratios, largest first. A variant
    that fails or misses the guard is screened at the next one."""
    found = []
    # On the baseline, so in float32 with every layer quantized (int8_fallback 0): the variant
    # that shrinks most, and on CPUs the only one int8 combines with.
    int8 = _variants(
        space,
        {"quantization": ("int8_dynamic",)},
        {"runtime": ("onnxruntime",), "ort_precision": ("int8_dynamic",)},
        {"quantization": ("int8_weight_only",)},
        {"quantization": ("int8_static",)},
    )
    if int8:
        found.append(Lever("int8", tuple(int8)))
    ratios = sorted((r for r in space.values.get("prune_ratio", ()) if r), reverse=True)
    if ratios:
        found.append(Lever("prune_ratio", tuple({"prune_ratio": r} for r in ratios)))
    return found


def workers_again(strategy: Any, top: Mapping[str, Any], costly: Mapping[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """Loader workers once more, on a CPU, around a best that has a costly build of its own
    (another runtime, int8, a compile) and no workers: the workers share the cores with the model, and what a
    faster model leaves them decides whether they pay. Only where they are screened first
    (photos decoded in ``__getitem__``): there, beside the plain model on 2 cores, 2 workers ran
    0.94 of the drafted decode alone and were dropped; beside OpenVINO the same workers ran 1.4
    of it, and 10 trials shipped 2.3x where 3.3x was there. ``strategy``: a
    :class:`~autotune.search.strategy.Staged`."""
    if strategy.device.startswith("cuda") or "num_workers" not in strategy.tier1 or not costly:
        return []
    lever = next((lever for lever in strategy.levers if lever.name == "num_workers"), None)
    if lever is None or not lever.variants or top.get("num_workers") != strategy.baseline.get("num_workers"):
        return []
    return [(dict(lever.variants[0]), top)]
