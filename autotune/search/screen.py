"""The staged strategy's first phases (see :mod:`autotune.search.strategy`): the recipe, the
levers measured together right after the baseline, and screening, each lever measured alone;
what the study's records say of them (each lever's speed against the baseline, the values left
out), and the thresholds the later phases judge by.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.config import Config
from autotune.knobs import REGISTRY, declared
from autotune.search.cost import HEAVY_KNOBS
from autotune.search.levers import FEED, Lever, levers, size_levers
from autotune.search.space import SearchSpace

# A lever pays when it is at least this much faster than the baseline (measurement noise is a few %).
MIN_GAIN = 1.03
# A value is left out when screening measured it below this share of the baseline's speed.
HARMFUL = 0.8
# A build of another runtime this close to the fastest cheap configuration has its own batch
# neighbours measured (see Screening._own_batches): within the drift of a machine's throughput
# between two trials.
NEAR = 0.8
# The levers screened alone against the baseline; the others are tried on the composed configuration.
# Those search/levers.py writes are named here; a knob with a lever of its own declares it
# (``first_tier``: autocast, the reduced-scale JPEG decode, training's optimizer implementation).
TIER1 = ("padding", "image_shape", "openvino", "int8", "compile_mode", "torchscript")


def tier1() -> tuple[str, ...]:
    """The first tier's levers: :data:`TIER1` and the knobs that declare ``first_tier``."""
    return (*TIER1, *declared("first_tier"))


# The levers measured together right after the baseline (their first variants), where the space
# offers at least two of them: what the data (padding, image sizes) and the device (16-bit units,
# since autocast is offered only there) already vouch for. The batch joins only for throughput.
RECIPE = ("padding", "image_shape", "amp_dtype", "batch_size")
# On a CPU, the recipe for token sequences keeps the user's batch (RECIPE without "batch_size"):
# a batch's longest row sets its trimmed width, so a larger batch pads more, and a CPU's cores
# gain nothing from it that a GPU's would. Pre-padded real MiniLM text on 2 AVX2 cores: trimmed
# and grouped at batch 128 ran 0.52x of the same at the user's 32, and 4 of 16 trials climbed
# back down; a 3-minute budget ended on the batch-128 recipe at 0.63 of the 16-trial winner.
# The batch is still climbed around the recipe, a step at a time.
# Of the data path's levers (:data:`autotune.search.levers.FEED`), what the recipe takes on
# CUDA: nothing there is worse off for them.
FEED_RECIPE = ("gather", "pin_memory")
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


def is_heavy(variants: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a lever's variants cost a build of their own (:data:`HEAVY_KNOBS`: a compile, an export, int8)."""
    return any(k in HEAVY_KNOBS for v in variants for k in v)


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


class Screening:
    """The staged strategy's first phases, the recipe and screening, and what the study's
    records say of them; :class:`autotune.search.strategy.Staged` composes on them."""

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
        self.tier1 = (tier1() + FEED if cuda else tier1()) if speed else SIZE_TIER1
        if speed and not cuda and any(lever.name == "jpeg_draft" for lever in found):
            # Photos decoded in __getitem__: the decode bounds the pipeline, and loader workers
            # are the other half of its cure (on 2 cores, one pass over 1-2 MP JPEGs with a light
            # CNN: drafted alone 2.0x, beside two workers' decoding the expert's workers alone
            # already ran 1.9x). Screened with the first tier.
            self.tier1 = (*self.tier1, "num_workers")
        self.baseline = dict(space.baseline)
        self.baseline_key = Config(self.baseline).key()
        names = RECIPE if objectives[0] == "throughput" else tuple(n for n in RECIPE if n != "batch_size")
        if not cuda and any(lever.name == "padding" for lever in found):
            names = tuple(n for n in names if n != "batch_size")  # see the note below RECIPE
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
            candidate = self._full(self._without(part), self._recipe)
            if self.runnable(candidate) and Config(candidate).key() != Config(self._recipe).key():
                found.append(candidate)
        return found

    def _without(self, part: Mapping[str, Any]) -> dict[str, Any]:
        """The changes that take a recipe's ``part`` back out: its knobs at the baseline's values,
        but shapes as symbols, which a compile fixed on keeps (a static compile of the user's
        own widths builds each anew: 73 s of an ablation trial on the Hugging Face pipeline)."""
        return {k: self.baseline[k] for k in part if k != "compile_dynamic"}

    def _kept_parts(self, scores: Mapping[str, float | None]) -> tuple[list[dict[str, Any]], float]:
        """The recipe's parts whose removal was not faster, and the best ratio to the baseline
        of the recipe and its ablations (measured so far)."""
        base = scores.get(self.baseline_key) or 1.0
        recipe = scores.get(Config(self._recipe).key()) or 0.0
        kept, best = [], recipe
        for lever, part in zip(self.recipe_levers, self.recipe_parts, strict=True):
            without = self._full(self._without(part), self._recipe)
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

    def score(self, record: Mapping[str, Any]) -> float | None:
        """``record``'s score, higher better (``None``: it failed or missed the guard)."""
        return _score(record, self.key, self.maximize)

    def _scores(self, records: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
        """Score by key of every configuration with a result (``None``: it failed or missed the guard)."""
        scores: dict[str, float | None] = {}
        refused = []
        for r in records:
            if r.get("kind") == "deadline" and not r.get("ran"):
                refused.append(r)
            elif "key" in r and r.get("status") not in (None, "skipped", "interrupted"):
                scores.setdefault(r["key"], _score(r, self.key, self.maximize))
        # A trial not started for the deadline counts as failed here, so the search moves on to a
        # cheaper lever, until it is queued again and measured (search.limits.requeue_refused; a
        # resumed run measures it too: see search.record._has_result).
        for r in refused:
            if "key" in r:
                scores.setdefault(r["key"], None)
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
        but for the levers named in ``skip``. The costly ones (:meth:`deferred`) come only once
        the cheap ones are decided, and only when none of those paid: else they are built once,
        on the best cheap composition. Real text: compile screened alone on the untrimmed batches
        took 40 s to say nothing the composition needed."""
        scores, chosen = self._scores(records), []
        for lever in [lever for lever in self.levers if lever.name in self.tier1 and lever.name not in skip]:
            for changes in lever.variants:
                config = self._full(changes)
                score = scores.get(Config(config).key(), "untried")
                if score == "untried":
                    chosen.append((is_heavy(lever.variants), config))
                if score is None:
                    continue  # failed or missed the guard: its next value is screened
                break
        if any(not heavy for heavy, _ in chosen) or self._cheap_paid(records):
            chosen = [(heavy, c) for heavy, c in chosen if not heavy]  # the costly levers wait, or are composed
        return [c for _, c in chosen if self.runnable(c)]

    def _cheap_paid(self, records: Sequence[Mapping[str, Any]]) -> bool:
        """Whether a cheap first-tier lever screened so far paid (:data:`MIN_GAIN`)."""
        cheap = {lever.name for lever in self.levers if not is_heavy(lever.variants)}
        return any(r is not None and r >= MIN_GAIN for n, (_, r) in self.screened(records).items() if n in cheap)

    def deferred(self, records: Sequence[Mapping[str, Any]]) -> list[Lever]:
        """The costly first-tier levers left unscreened because a cheap one paid: the
        composition tries them on its best cheap configuration."""
        if not self._cheap_paid(records):
            return []
        screened = self.screened(records)
        return [
            lever
            for lever in self.levers
            if lever.name in self.tier1 and lever.name not in screened and is_heavy(lever.variants)
        ]

    def _keeps(self, config: Mapping[str, Any], changes: Mapping[str, Any]) -> bool:
        """Whether ``config`` holds every one of ``changes``, each still in effect."""
        return all(config.get(k) == v and REGISTRY[k].applies(dict(config)) for k, v in changes.items())

    def _onward(self, changes: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A costly lever's variants from ``changes`` on, the others ``changes`` alone: composed,
        a costly lever goes on to its next variant when one does not pay there. OpenVINO float32
        composed onto trimmed batches is the same configuration as screened alone, and its bf16
        (9.1x against float32's 5.6x on real text) was never tried."""
        if not is_heavy([changes]):
            return [dict(changes)]
        lever = next((lever for lever in self.levers if changes in lever.variants), None)
        return [dict(v) for v in lever.variants[lever.variants.index(changes) :]] if lever else [dict(changes)]

    def _symbols(self, changes: Mapping[str, Any], config: Mapping[str, Any]) -> Mapping[str, Any]:
        """``changes`` with shapes as symbols where they compile onto trimmed padding: a static
        compile builds each width anew up to dynamo's recompile limit and runs the rest eager
        (on real text, 89 s of a 100-s trial for no gain, then the same again with freezing)."""
        trimmed = config.get("padding", "as_given") != "as_given"
        if not trimmed or "compile_mode" not in changes or "compile_dynamic" in changes:
            return changes
        return {**changes, "compile_dynamic": True} if True in self.space.values.get("compile_dynamic", ()) else changes

    def _builds(
        self,
        steps: Sequence[Sequence[Mapping[str, Any]]],
        current: dict[str, Any],
        held: list[Mapping[str, Any]],
        scores: Mapping[str, Any],
    ) -> list[dict[str, Any]]:
        """The first variant of each costly lever in ``steps`` on ``current`` not measured yet
        (in ``scores``): what the builds to come would measure (their prices are what matters)."""
        found = [self._unmeasured(variants[0], current, held, scores) for variants in steps]
        return [c for c in found if c is not None]

    def _unmeasured(
        self,
        changes: Mapping[str, Any],
        current: dict[str, Any],
        held: list[Mapping[str, Any]],
        scores: Mapping[str, Any],
    ) -> dict[str, Any] | None:
        """The costly build ``changes`` on ``current`` (added, or in place of what it masks), or
        ``None`` where it cannot run there or is measured already (in ``scores``)."""
        changes = self._symbols(changes, current)
        candidate = self._add(current, held, changes) or self._replace(current, held, changes)[0]
        return None if candidate is None or Config(candidate).key() in scores else candidate

    def _replace(
        self, config: Mapping[str, Any], held: list[Mapping[str, Any]], changes: Mapping[str, Any]
    ) -> tuple[dict[str, Any] | None, list[Mapping[str, Any]]]:
        """``config`` with ``changes`` in place of the held parts they mask or cannot run beside,
        and the parts it keeps: a runtime with a precision of its own replaces autocast (OpenVINO,
        ONNX Runtime), and CPU int8 runs float32. ``(None, held)`` when it still cannot run.

        Built on the composition, not on the baseline: on real MiniLM text (AVX-512 with bf16
        units) trimmed, grouped batches in bf16 autocast ran 7.5x, and neither OpenVINO (9.1x in
        bf16, 13x in NNCF int8 on the same batches) nor any int8 was tried, since each masks it."""
        merged = self._full(changes, config)
        if not self._keeps(merged, changes):
            return None, held  # masked by what is held (a compile under OpenVINO): it replaces nothing
        kept = [c for c in held if self._keeps(merged, c)]
        while True:
            # A dropped part's knobs go back to the baseline's, but those a kept part holds too
            # (OpenVINO's variant carries the trimmed shape the padding part holds).
            dropped = {
                k: self.baseline[k]
                for c in held
                if c not in kept
                for k in c
                if k not in changes and not any(k in p for p in kept)
            }
            candidate = self._full(changes, {**config, **dropped})
            if self.runnable(candidate) and all(self._keeps(candidate, c) for c in (*kept, changes)):
                return candidate, [*kept, changes]
            if not kept:
                return None, held
            kept = kept[:-1]  # the latest part goes first: the earlier ones measured larger

    def _add(self, config: dict[str, Any], held: list[Mapping[str, Any]], changes: Mapping[str, Any]) -> Any:
        """``config`` with ``changes`` added, if it can run and masks none of ``held`` (ONNX
        Runtime makes autocast and compile moot, say); else ``None``."""
        merged = self._full(changes, config)
        if not self.runnable(merged) or not all(self._keeps(merged, c) for c in (*held, changes)):
            return None
        return merged

    def _own_batches(
        self, ranked: Sequence[Mapping[str, Any]], cheap: Mapping[str, Any], scores: Mapping[str, Any]
    ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(change, configuration) pairs: the batch sizes one step larger and smaller than the
        fastest measured build of another runtime, where it runs at least :data:`NEAR` of the
        cheap builds' best (``cheap``): an export, not a compile per shape, has a best batch of
        its own. OpenVINO int8 on real text ran 7% faster at 64 than at the cheap best's 32, and
        only the cheap best's neighbours were tried. Near, not only ahead: bf16 on 2 cores with
        AMX ran 1.5x its usual speed for seconds at a time, twice in one day at a batch of 64
        (774 and 863 samples/s, against 418-564 in other runs). The costly builds went onto that
        batch, OpenVINO int8 ran 0.81-0.87 of the lucky figure there and was never tried at 32,
        where it ran 5.5-6.9x the baseline in every other run: those runs shipped bf16 at 3.3-3.7x."""
        sizes = sorted(self.space.values.get("batch_size", ()))
        other = [r for r in ranked if r["config"].get("runtime", "torch") != self.baseline.get("runtime", "torch")]
        if not other:
            return []
        fastest = max(other, key=lambda r: scores[r["key"]])
        config = dict(fastest["config"])
        near = scores[fastest["key"]] >= NEAR * (scores.get(cheap.get("key", "")) or 0.0)
        if not (near and config.get("batch_size") in sizes):
            return []
        i = sizes.index(config["batch_size"])
        return [({"batch_size": sizes[j]}, config) for j in (i + 1, i - 1) if 0 <= j < len(sizes)]
