"""The staged strategy: screen each lever alone, compose those that paid, refine with TPE.

An engineer tuning a pipeline by hand measures each big change once against the baseline,
then puts together the ones that paid, largest first, and keeps each addition only if it is
measured better. TPE alone does not: it finds the big levers one at a time and seldom combines
them within a small budget. So a study run with ``strategy="staged"`` goes through three phases:

* **Recipe.** Right after the baseline, the levers the machine and the data already vouch for
  are measured together, as an engineer would start: padding trimmed with length grouping
  (token sequences), images padded to fewer shapes (images of many sizes), autocast (offered
  only where the device has 16-bit units) and, for throughput, a larger batch. Their effects
  multiply, so together they are the predicted best of those levers; when it pays, the search
  builds on it at once instead of measuring each alone first. On a measured table of real
  MiniLM text (108 configurations with compile and ONNX Runtime) it reaches 95% of the optimum
  in 4 trials, where screening each lever alone first took 7.
* **Screen.** Each *lever* (the knobs that form one idea: autocast, trimmed padding with
  length grouping, ``torch.compile``, ONNX Runtime int8, a larger batch, fewer threads, ...)
  is measured alone at its most promising value. A lever whose first value cannot run or
  fails the guard is screened at its next value.
* **Compose.** The levers that paid are combined greedily onto the best start (the recipe
  when it paid and beats every lever alone, else the largest lever), largest measured effect
  first, keeping each addition only if measured better. Combinations the space knows cannot
  run (autocast with CPU int8) are not proposed. When the recipe paid, only the levers outside
  it are screened (alone) before composing, and each of the recipe's levers is taken back out
  once around the best (an ablation): one that costs inside the recipe is found that way.
* **Refine.** Nothing is queued any more: the study's TPE sampler proposes the rest, and it
  has seen every trial measured so far.

A value that screening measured clearly slower than the baseline (one thread on two cores,
bfloat16 emulated) is *left out* for the rest of the study: a sampled configuration holding it
is refused before it runs, with the reason ``left out after screening: measured 0.50x``.

Nothing here keeps state of its own: the next configurations are derived from the study's
trials every time, so a resumed study, or several workers sharing one, continue where the
study stands, and a configuration already measured, running or queued is never queued again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.config import Config
from autotune.errors import ConfigError
from autotune.knobs import REGISTRY
from autotune.search.cost import HEAVY_KNOBS
from autotune.search.space import SearchSpace

__all__ = ["STRATEGIES", "Lever", "Staged", "check_strategy", "levers", "queue_next", "size_levers"]

STRATEGIES = ("staged", "tpe")
# A lever pays when it is at least this much faster than the baseline (measurement noise is a few %).
MIN_GAIN = 1.03
# A value is left out when screening measured it below this share of the baseline's speed.
HARMFUL = 0.8
# The levers screened alone against the baseline; the others are tried on the composed configuration.
# The optimizer's implementation is training's own first-tier lever (inference offers one value).
TIER1 = ("padding", "image_shape", "amp_dtype", "openvino", "int8", "compile_mode", "optimizer_impl")
# The levers measured together right after the baseline (their first variants), where the space
# offers at least two of them: what the data (padding, image sizes) and the device (16-bit units,
# since autocast is offered only there) already vouch for. The batch joins only for throughput.
RECIPE = ("padding", "image_shape", "amp_dtype", "batch_size")
# On CUDA the data path to the device is tuned like the model, ahead of compile: one index
# operation per batch for tensor-backed data, pinned memory with the next batch copied on a side
# stream, workers kept alive with batches prefetched. A ResNet-50 fed per-sample collated batches
# from pageable memory sat at 3,000 img/s on an H100 for every model recipe (bf16, compile).
FEED = ("gather", "pin_memory", "num_workers")
# Of these, what the recipe takes on CUDA: nothing there is worse off for them.
FEED_RECIPE = ("gather", "pin_memory")
# Loader workers on CUDA: as many as this, within the usable CPUs (the expert recipe's 8).
CUDA_WORKERS = 8
# With size first, the levers are the ones that shrink the model, every one screened alone.
SIZE_TIER1 = ("int8", "prune_ratio")
# Knobs whose effect depends on the other's value: a loader worker process takes a core the
# model's threads wanted (on 2 cores, 2 workers beside 2 threads measured 0.22x; beside 1 thread
# they hide the decoding). A value measured harmful is left out only beside the partner's value
# it was measured with.
PARTNERS = {"num_threads": "num_workers", "num_workers": "num_threads"}
# The precision knob of each exported runtime: a runtime is left out only at the precision it
# was measured with.
_PRECISION_OF = {"onnxruntime": "ort_precision", "openvino": "ov_precision"}


def check_strategy(name: Any) -> str:
    """Return ``name`` if it is a known strategy.

    Raises:
        ConfigError: it is not one of :data:`STRATEGIES`.
    """
    if name not in STRATEGIES:
        raise ConfigError(f"No strategy named {name!r}. Known: {', '.join(STRATEGIES)}.")
    return name


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


def levers(space: SearchSpace, cores: int | None = None, device: str = "cpu") -> list[Lever]:
    """The levers the space offers, in order of promise (the order they are screened in).

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
    found: list[Lever] = []

    def add(name: str, variants: list[dict[str, Any]]) -> None:
        if variants:
            found.append(Lever(name, tuple(variants)))

    shape = _variants(space, {"padding": ("trim", "trim_8", "trim_16"), "length_grouping": (16, 4, 64)})
    add("padding", shape or _variants(space, {"padding": ("trim", "trim_8", "trim_16")}))
    # Images of many sizes: padded to fewer shapes and batched with their like (grouping alone
    # behind the user's own collate, which does the padding).
    image = _variants(space, {"image_padding": ("largest_32", "largest_16"), "size_grouping": (16, 4, 64)})
    add("image_shape", image or _variants(space, {"size_grouping": (16, 4, 64)}))
    add("amp_dtype", _variants(space, {"amp_dtype": ("bfloat16",)}, {"amp_dtype": ("float16",)}))
    auto = {"int8_fallback": ("auto",)} if "auto" in space.values.get("int8_fallback", ()) else {}
    ov_float, ov_int8 = _openvino(space, shape, auto)
    add("openvino", ov_float)
    workers = [n for n in space.values.get("num_workers", ()) if n and n > 0]
    cuda = device.startswith("cuda")
    if cuda:
        add("gather", _variants(space, {"gather": ("batched",)}))
        add(
            "pin_memory",
            _variants(space, {"pin_memory": (True,), "device_prefetch": (True,)}, {"pin_memory": (True,)}),
        )
        if workers and base.get("num_workers") == 0:
            n = _nearest(workers, min(CUDA_WORKERS, cores))
            kept = {"num_workers": (n,), "persistent_workers": (True,), "prefetch_factor": (4, 8)}
            add("num_workers", _variants(space, kept, {"num_workers": (n,), "persistent_workers": (True,)}) or
                [{"num_workers": n}])  # fmt: skip
    ort = {"runtime": ("onnxruntime",), "ort_precision": ("int8_dynamic",)}
    add(
        "int8",
        ov_int8
        + _variants(
            space,
            {**ort, **auto},
            {"quantization": ("int8_dynamic",), **auto},
            {"runtime": ("onnxruntime",)},
        ),
    )
    # Token sequences of many lengths whose padding the space may trim: a static compile makes
    # one graph per width and past dynamo's recompile limit (8) runs the others eager, inside
    # the trial's windows (real MiniLM text: "size mismatch at index 1, expected 28, actual 18").
    # Shapes as symbols come first.
    dynamic = _variants(space, {"compile_mode": ("default",), "compile_dynamic": (True,)}) if shape else []
    add(
        "compile_mode",
        [*dynamic, *_variants(space, {"compile_mode": ("default",)}, {"compile_mode": ("default-freezing",)})],
    )
    larger = [b for b in space.values.get("batch_size", ()) if b > base["batch_size"]]
    if larger:
        add("batch_size", [{"batch_size": _nearest(larger, 4 * base["batch_size"])}])
    fewer = [n for n in space.values.get("num_threads", ()) if n is not None and n < (base.get("num_threads") or 0)]
    if fewer:
        add("num_threads", [{"num_threads": _nearest(fewer, max(1.0, cores / 2))}])
    # Decoding once before loader workers: over repeated epochs (or repeated inference over a
    # fixed set) the cache removes the decoding that workers would only hide, and leaves the
    # cores to the model. Beside workers it needs them persistent, or each epoch loses it.
    add(
        "cache_decoded",
        _variants(space, {"cache_decoded": (True,)}, {"cache_decoded": (True,), "persistent_workers": (True,)}),
    )
    if workers and base.get("num_workers") == 0 and not cuda:
        n = _nearest(workers, min(2, cores))
        # The workers beside the threads they leave free (a perf guide's recipe: workers plus
        # threads = cores), then beside the baseline's threads.
        free = _variants(space, {"num_workers": (n,), "num_threads": (max(1, cores - n),)})
        add("num_workers", [*free, {"num_workers": n}])
    for name, value in (
        ("channels_last", True),
        ("optimizer_impl", "fused"),
        ("cudnn_benchmark", True),
        ("tf32", True),
        ("flush_denormal", True),
    ):
        add(name, _variants(space, {name: (value,)}))
    return found


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


def _beside(changes: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` with the value of each changed knob's partner (:data:`PARTNERS`) in ``config``,
    the configuration they were measured in: a left-out value is refused only beside it.

    Example:
        >>> _beside({"num_workers": 2}, {"num_workers": 2, "num_threads": 2, "batch_size": 8})
        {'num_workers': 2, 'num_threads': 2}
    """
    found = dict(changes)
    for name in changes:
        partner = PARTNERS.get(name)
        if partner is not None and partner in config:
            found.setdefault(partner, config[partner])
    # A runtime measured slow at one precision says nothing of another: OpenVINO float32 at
    # 0.64x of the composed best left its int8 out unmeasured.
    precision = _PRECISION_OF.get(changes.get("runtime"))
    if precision is not None and precision in config:
        found.setdefault(precision, config[precision])
    return found


def _score(record: Mapping[str, Any], key: str, maximize: bool) -> float | None:
    # A trial stopped early was measured far below the best: a speed, not a fault.
    if record.get("status") not in ("ok", "stopped") or record.get(key) in (None, 0):
        return None
    value = float(record[key])
    return value if maximize else 1.0 / value


class Staged:
    """The staged strategy for one study; see the module docstring.

    Args:
        space: The resolved search space.
        objectives: The study's objectives; the first decides what "faster" means. With neither
            throughput nor latency first, there is nothing to screen and TPE runs alone.
        device: ``"cpu"`` or ``"cuda..."``: autocast does not combine with CPU int8.
        cores: Physical cores (default: the baseline's thread count).

    Example:
        >>> from autotune.search.space import SearchSpace
        >>> from autotune.knobs import REGISTRY
        >>> base = {n: k.default for n, k in REGISTRY.items()} | {"num_threads": 2}
        >>> space = SearchSpace({**{n: [v] for n, v in base.items()}, "batch_size": [32, 128]}, base, {})
        >>> [lever.name for lever in Staged(space, ["throughput"]).levers]
        ['batch_size']
    """

    def __init__(
        self, space: SearchSpace, objectives: Sequence[str], device: str = "cpu", cores: int | None = None
    ) -> None:
        from autotune.search.select import OBJECTIVES

        self.space, self.device = space, device
        key, direction = OBJECTIVES[objectives[0]][:2]
        self.key, self.maximize = key, direction == "maximize"
        speed = objectives[0] in ("throughput", "latency")
        cuda = device.startswith("cuda")
        found = levers(space, cores, device) if speed else size_levers(space) if objectives[0] == "size" else []
        self.levers = found
        self.tier1 = (TIER1 + FEED if cuda else TIER1) if speed else SIZE_TIER1
        self.baseline = dict(space.baseline)
        self.baseline_key = Config(self.baseline).key()
        names = RECIPE if objectives[0] == "throughput" else tuple(n for n in RECIPE if n != "batch_size")
        names += FEED_RECIPE if cuda else ()
        self.recipe_levers = [lever for lever in self.levers if lever.name in names] if speed else []
        # Each recipe lever's first variant: the changes the recipe holds.
        self.recipe_parts = [dict(lever.variants[0]) for lever in self.recipe_levers]
        self._recipe = self._make_recipe()

    def recipe(self) -> dict[str, Any] | None:
        """The recipe (:data:`RECIPE`: each lever's first variant, together), or ``None`` when the
        space offers fewer than two of its levers (one alone is what screening measures) or they
        cannot run together."""
        return None if self._recipe is None else dict(self._recipe)

    def _make_recipe(self) -> dict[str, Any] | None:
        parts = self.recipe_parts
        if len(parts) < 2:
            return None
        config = self._full({k: v for part in parts for k, v in part.items()})
        if not self.runnable(config) or not all(self._keeps(config, part) for part in parts):
            return None
        return config

    def _on_recipe(self, scores: Mapping[str, float | None]) -> list[str]:
        """The first-tier levers outside a recipe that paid which can be added to it (their first
        variant runs on it and masks none of it): they are screened on the recipe instead of
        alone. Empty when the recipe did not pay."""
        if self._recipe_paid(scores) is None:
            return []
        names = [lever.name for lever in self.recipe_levers]
        return [
            lever.name
            for lever in self.levers
            if lever.name in self.tier1
            and lever.name not in names
            and any(self._add(self._recipe, self.recipe_parts, v) is not None for v in lever.variants)
        ]

    def _ablations(self, scores: Mapping[str, float | None]) -> list[dict[str, Any]]:
        """The recipe with each of its levers (but the batch) taken back out, when the recipe
        paid: measured right after it, before anything is built on it, so a lever that costs
        inside it (bf16 on a CPU without AMX, on text: the recipe ran 1.20x, without bf16 2.7x)
        is found in seconds, not after nine compiles on top of it."""
        if self._recipe_paid(scores) is None:
            return []
        found = []
        for lever, part in zip(self.recipe_levers, self.recipe_parts, strict=True):
            if lever.name == "batch_size":
                continue
            candidate = self._full({k: self.baseline[k] for k in part}, self._recipe)
            if self.runnable(candidate) and Config(candidate).key() != Config(self._recipe).key():
                found.append(candidate)
        return found

    def _kept_parts(self, scores: Mapping[str, float | None]) -> tuple[list[dict[str, Any]], float]:
        """The recipe's parts whose removal was not faster, and the best ratio to the baseline
        of the recipe and its ablations (measured so far)."""
        base = scores.get(self.baseline_key) or 1.0
        recipe = scores.get(Config(self._recipe).key()) or 0.0
        kept, best = [], recipe
        for lever, part in zip(self.recipe_levers, self.recipe_parts, strict=True):
            without = self._full({k: self.baseline[k] for k in part}, self._recipe)
            score = scores.get(Config(without).key()) if lever.name != "batch_size" else None
            if score is not None and score > recipe:
                best = max(best, score)
                continue  # it cost inside the recipe
            kept.append(part)
        return kept, best / base

    def _recipe_paid(self, scores: Mapping[str, float | None]) -> float | None:
        """The recipe's speed against the baseline when it was measured and paid, else ``None``."""
        base = scores.get(self.baseline_key)
        found = scores.get(Config(self._recipe).key()) if self._recipe is not None else None
        if found is None or not base or found < MIN_GAIN * base:
            return None
        return found / base

    def _full(self, changes: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The whole configuration as the study loop builds it from the same parameters:
        ``changes`` on ``base`` (default: the baseline with the knobs the user fixed), and each
        knob that does not apply, given the knobs before it, at its baseline value."""
        space = self.space
        wanted = {**(base or {n: v[0] if len(v) == 1 else space.baseline[n] for n, v in space.values.items()})}
        wanted.update(changes)
        config: dict[str, Any] = {}
        for name, knob in REGISTRY.items():
            config[name] = wanted[name] if knob.applies(config) else space.baseline[name]
        return config

    def runnable(self, config: Mapping[str, Any]) -> bool:
        """Whether the space knows ``config`` can run: in the space, and no autocast with CPU int8."""
        if not self.space.contains(config):
            return False
        cpu_int8 = config.get("quantization") in ("int8_dynamic", "int8_static") and not self.device.startswith("cuda")
        return not (cpu_int8 and REGISTRY["amp_dtype"].applies(dict(config)) and config["amp_dtype"] != "float32")

    # ---- what the records say -------------------------------------------------------------

    def _scores(self, records: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
        """Score by key of every configuration with a result (``None``: it failed or missed the guard)."""
        scores: dict[str, float | None] = {}
        for r in records:
            # A trial not started for the deadline counts as failed here, so the search moves on
            # to a cheaper lever (a resumed run still measures it: see search.record._has_result).
            if "key" in r and r.get("status") not in (None, "skipped", "interrupted"):
                scores.setdefault(r["key"], _score(r, self.key, self.maximize))
        return scores

    def screened(self, records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[dict[str, Any], float | None]]:
        """Per lever screened so far: the variant that decided it and its speed against the
        baseline (``None``: every variant tried failed or missed the guard)."""
        scores = self._scores(records)
        base = scores.get(self.baseline_key)
        found = {}
        for lever in self.levers:
            for changes in lever.variants:
                key = Config(self._full(changes)).key()
                if key not in scores:
                    break
                if scores[key] is not None and base:
                    found[lever.name] = (dict(changes), scores[key] / base)
                    break
                found[lever.name] = (dict(changes), None)
        return found

    def left_out(self, records: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], float]]:
        """The changes screening measured clearly slower than the baseline, with their ratio."""
        return self._alone_harmful(records) + self.composition(records)[1]

    def _alone_harmful(self, records: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], float]]:
        found = []
        for name, (changes, ratio) in self.screened(records).items():
            if ratio is None or ratio >= HARMFUL:
                continue
            context = _beside(changes, self._full(changes))
            if name in self.tier1:
                # Screened alone at the baseline's batch, and the batch interacts with everything:
                # bfloat16 on a small MLP ran 0.67x at batch 32 and was the optimum at 512.
                context.setdefault("batch_size", self._full(changes)["batch_size"])
            found.append((context, ratio))
        return found

    def refusal(self, config: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> str | None:
        """Why ``config`` is not run (it holds a value left out after screening), or ``None``."""
        return self._refuse(config, self.left_out(records))

    def _refuse(self, config: Mapping[str, Any], left_out: Sequence[tuple[Mapping[str, Any], float]]) -> str | None:
        for changes, ratio in left_out:
            if all(config.get(k) == v and REGISTRY[k].applies(dict(config)) for k, v in changes.items()):
                what = ", ".join(f"{k}={v}" for k, v in changes.items())
                return f"left out after screening: measured {ratio:.2f}x with {what}"
        return None

    # ---- what to measure next -------------------------------------------------------------

    def screening(
        self, records: Sequence[Mapping[str, Any]], n_trials: int, skip: Sequence[str] = ()
    ) -> list[dict[str, Any]]:
        """The screening configurations not yet decided: each first-tier lever's next variant,
        but for the levers named in ``skip``."""
        scores, chosen = self._scores(records), []
        for lever in [lever for lever in self.levers if lever.name in self.tier1 and lever.name not in skip]:
            for changes in lever.variants:
                config = self._full(changes)
                score = scores.get(Config(config).key(), "untried")
                if score == "untried":
                    chosen.append(config)
                if score is None:
                    continue  # failed or missed the guard: its next value is screened
                break
        return [c for c in chosen if self.runnable(c)]

    def _keeps(self, config: Mapping[str, Any], changes: Mapping[str, Any]) -> bool:
        """Whether ``config`` holds every one of ``changes``, each still in effect."""
        return all(config.get(k) == v and REGISTRY[k].applies(dict(config)) for k, v in changes.items())

    def _add(self, config: dict[str, Any], held: list[Mapping[str, Any]], changes: Mapping[str, Any]) -> Any:
        """``config`` with ``changes`` added, if it can run and masks none of ``held`` (ONNX
        Runtime makes autocast and compile moot, say); else ``None``."""
        merged = self._full(changes, config)
        if not self.runnable(merged) or not all(self._keeps(merged, c) for c in (*held, changes)):
            return None
        return merged

    def composition(
        self, records: Sequence[Mapping[str, Any]], first_tier_only: bool = False
    ) -> tuple[dict[str, Any] | None, list[Any]]:
        """The next configuration to compose, or ``None`` when composing is done, and the
        changes measured clearly harmful on top of the composed configuration.

        The screened levers that paid are added to the largest one's configuration in order of
        their effect, each kept only if it pays on it (:data:`MIN_GAIN`: their effects multiply
        when they do not interact, and a pair that does is caught here). The levers of the second
        tier (batch, threads, loader, layout, ...) are then tried on top of what was composed,
        one at a time, also kept only if they pay: their effect depends most on what else
        changed, and one kept for a gain within the noise can cost later. On CRAFT over 16x
        page scans, one thread measured 1.7% faster while decoding bound the pipeline; kept, it
        halved the model once the decoded-sample cache removed the decoding.
        """
        scores = self._scores(records)
        paid = sorted(
            ((r, [c]) for c, r in self.screened(records).values() if r is not None and r >= MIN_GAIN),
            key=lambda rc: -rc[0],
        )
        recipe_ratio = self._recipe_paid(scores)
        if recipe_ratio is not None:
            # The recipe is one start among the levers alone: the fastest one is built on, and
            # the recipe's levers are steps when a lever alone beat it. A lever whose removal
            # right after the recipe (see _ablations) ran faster is left out of what is built on.
            kept, recipe_ratio = self._kept_parts(scores)
            paid = sorted([(recipe_ratio, kept), *paid], key=lambda rc: -rc[0])
        start = paid[0][1] if paid else []
        current = self._full({k: v for c in start for k, v in c.items()})
        held: list[Mapping[str, Any]] = list(start)
        harmful: list[Any] = []
        # After a recipe that paid, the first-tier levers it can take are screened on it, not alone.
        on_recipe = self._on_recipe(scores)
        first = [[c] for _, cs in paid[1:] for c in cs if c not in held] + [
            list(lever.variants) for lever in self.levers if lever.name in on_recipe
        ]
        # Cheap changes first (data shape, precision, loader: seconds each); a costly build
        # (compile, int8, another runtime) is tried once, on the best cheap composition.
        heavy = [steps for steps in first if any(k in HEAVY_KNOBS for c in steps for k in c)]
        first = [steps for steps in first if steps not in heavy]
        # The recipe's own levers (its batch) are not tried again on what was built on it.
        inside = {lever.name for lever in self.recipe_levers} if recipe_ratio is not None else set()
        second = [
            list(lever.variants)
            for lever in self.levers
            if not first_tier_only and lever.name not in self.tier1 and lever.name not in inside
        ]
        for tier, steps in enumerate((first, heavy, second)):
            if tier == 1 and steps and recipe_ratio is not None and first_tier_only:
                # The batch around the cheap composition is climbed before a costly build.
                climb = self._interactions(records, scores, self._alone_harmful(records) + harmful, batch_only=True)
                if climb is not None:
                    return climb, harmful
            if tier and recipe_ratio is not None:
                # The batch around a recipe was climbed before screening: the costly builds and
                # the second tier go on the fastest configuration holding the rest of what was kept.
                current, held = self._climbed(records, scores, current, held)
            for variants in steps:
                for changes in variants:  # the next variant only while none before it was kept
                    candidate = self._add(current, held, changes)
                    if candidate is None or Config(candidate).key() == Config(current).key():
                        continue
                    key, now = Config(candidate).key(), scores.get(Config(current).key())
                    if key not in scores:
                        return candidate, harmful
                    if scores[key] is not None and now and scores[key] / now < HARMFUL:
                        harmful.append((_beside(changes, candidate), scores[key] / now))
                    if (scores[key] or 0.0) >= MIN_GAIN * (now or 0.0):
                        current, held = candidate, [*held, changes]
                        break
        left_out = self._alone_harmful(records) + harmful
        return self._interactions(records, scores, left_out, batch_only=first_tier_only), harmful

    def _climbed(
        self,
        records: Sequence[Mapping[str, Any]],
        scores: Mapping[str, Any],
        current: dict[str, Any],
        held: list[Mapping[str, Any]],
    ) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
        """``current`` moved to the fastest measured configuration that holds every change in
        ``held`` but the batch size (the batch neighbours measured around it), with the batch
        left out of ``held``; as it was when none is faster."""
        held = [{k: v for k, v in c.items() if k != "batch_size"} for c in held]
        held = [c for c in held if c]
        best, now = current, scores.get(Config(current).key()) or 0.0
        for r in records:
            score = scores.get(r.get("key", ""))
            if "config" in r and score is not None and score > now and all(self._keeps(r["config"], c) for c in held):
                best, now = dict(r["config"]), score
        return best, held

    def _interactions(
        self, records: Sequence[Mapping[str, Any]], scores: Mapping[str, Any], left_out: list, batch_only: bool = False
    ) -> Any:
        """Around the best configuration measured so far, the first untried of: CUDA graphs
        (``reduce-overhead``) where its trial was launch-bound, the batch size
        one step larger (the batch interacts with everything), each first-tier lever that did
        not pay at the baseline's batch, at the best's, the batch size one step smaller, and
        shapes as symbols when it compiles trimmed padding."""
        ranked = [r for r in records if r.get("key") in scores and scores[r["key"]] is not None and "config" in r]
        if not ranked:
            return None
        top = max(ranked, key=lambda r: scores[r["key"]])
        best = dict(top["config"])
        sizes = sorted(self.space.values.get("batch_size", ()))
        larger: list[dict[str, Any]] = []
        smaller: list[dict[str, Any]] = []
        if best.get("batch_size") in sizes:
            i = sizes.index(best["batch_size"])
            larger = [{"batch_size": sizes[i + 1]}] if i + 1 < len(sizes) else []
            smaller = [{"batch_size": sizes[i - 1]}] if i > 0 else []
        # A first-tier lever that did not pay at the baseline's batch, tried once more at the best
        # one's: its effect depends on the batch (autocast's cost per call, say, is paid back only
        # by large batches). Before the smaller batch: on digits, bfloat16 ran 1.01x at batch 32
        # and a 10-trial budget ended on the two batch neighbours before it was tried at 128.
        again = [
            dict(changes)
            for name, (changes, ratio) in self.screened(records).items()
            if name in self.tier1
            and ratio is not None
            and ratio < MIN_GAIN
            and best.get("batch_size") != self._full(changes).get("batch_size")
        ]
        dynamic = [{"compile_dynamic": True}] if best.get("padding", "as_given") != "as_given" else []
        # The model alone said the host's kernel launches bound it (small batches, small models):
        # CUDA graphs replay the launches, first thing around the best.
        graphs = [{"compile_mode": "reduce-overhead"}] if top.get("bound") == "launch-bound" else []
        # Each of the recipe's levers (but the batch, which the neighbours cover) taken back out of
        # the best, when the recipe paid: measured only together, one of them may cost inside it.
        ablations = []
        if self._recipe_paid(scores) is not None:
            for lever, part in zip(self.recipe_levers, self.recipe_parts, strict=True):
                if lever.name != "batch_size" and self._keeps(best, part):
                    ablations.append({k: self.baseline[k] for k in part})
        moves = [*larger, *smaller] if batch_only else [*graphs, *larger, *again, *smaller, *ablations, *dynamic]
        for changes in moves:
            candidate = self._full(changes, best)
            key = Config(candidate).key()
            if self._keeps(candidate, changes) and self.runnable(candidate) and key not in scores:
                if self._refuse(candidate, left_out) is None:
                    return candidate
        return None

    def next_configs(self, records: Sequence[Mapping[str, Any]], n_trials: int) -> tuple[str, list[dict[str, Any]]]:
        """The phase the study is in and what to queue for it: the screening configurations
        left, else the next composition, else nothing (``"refine"``: TPE proposes)."""
        scores = self._scores(records)
        if self.baseline_key not in scores:
            return "baseline", []  # queued by the study loop itself
        if self._recipe is not None and Config(self._recipe).key() not in scores:
            return "recipe", [self.recipe()]
        # A recipe that paid stands for its levers' screening (they are measured inside it), and
        # the levers it can take are screened on it, in the composition.
        skip = []
        if self._recipe_paid(scores) is not None:
            ablate = [c for c in self._ablations(scores) if Config(c).key() not in scores]
            if ablate:
                return "compose", ablate
            # Built on first: the cheap first-tier levers it can take, the batch around the
            # best, then the costly builds on that.
            composed, _ = self.composition(records, first_tier_only=True)
            if composed is not None:
                return "compose", [composed]
            skip = [lever.name for lever in self.recipe_levers] + self._on_recipe(scores)
        screen = self.screening(records, n_trials, skip)
        if screen:
            return "screen", screen
        composed, _ = self.composition(records)
        return ("compose", [composed]) if composed is not None else ("refine", [])


def queue_next(study: Any, strategy: Staged, n_trials: int) -> str:
    """Queue in ``study`` what ``strategy`` says comes next and is not measured, running or
    queued already (by this worker or another); return the phase.

    Every worker calls this before it asks for a trial, so the phases advance from the study's
    records alone. Two workers that queue the same configuration at the same moment still
    measure it once: the study loop's claim on its key lets only one of them run it.
    """
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    # The study's records as search.record.trial_record makes them (not imported: study imports this module).
    records = [
        {**t.user_attrs, "number": t.number, "state": t.state.name}
        for t in trials
        if t.state.is_finished() and "status" in t.user_attrs
    ]
    known = {r["key"] for r in records if "key" in r and r["status"] not in ("skipped", "interrupted")}
    known |= {t.user_attrs["key"] for t in trials if t.state == TrialState.RUNNING and "key" in t.user_attrs}
    for t in trials:
        if t.state == TrialState.WAITING and "fixed_params" in t.system_attrs:
            known.add(Config(strategy._full(t.system_attrs["fixed_params"])).key())
    phase, configs = strategy.next_configs(records, n_trials)
    for config in configs:
        key = Config(config).key()
        if key in known:
            continue
        known.add(key)
        params = {n: config[n] for n in strategy.space.searched if REGISTRY[n].applies(config)}
        study.enqueue_trial(params, user_attrs={"phase": phase, "queued_key": key}, skip_if_exists=True)
    if configs:
        _withdraw_twins(study)
    return phase


def _withdraw_twins(study: Any) -> None:
    """Of queued trials with the same configuration (two workers queued it at the same moment),
    keep the oldest: the others are failed while still waiting, marked ``withdrawn``."""
    import contextlib

    from optuna.trial import TrialState

    storage, seen = study._storage, set()
    for t in study.get_trials(deepcopy=False):
        key = t.user_attrs.get("queued_key")
        if key is None:
            continue
        if key in seen and t.state == TrialState.WAITING:
            # Taken as a worker's ask takes a queued trial: atomically, and only if still waiting
            # (another worker may have asked for it, or withdrawn it, first).
            with contextlib.suppress(Exception):
                if storage.set_trial_state_values(t._trial_id, TrialState.RUNNING):
                    storage.set_trial_user_attr(t._trial_id, "withdrawn", True)
                    storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        seen.add(key)
