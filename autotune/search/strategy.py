"""The staged strategy: screen each lever alone, compose those that paid, refine with TPE.

An engineer tuning a pipeline by hand measures each big change once against the baseline,
then puts together the ones that paid, largest first, and keeps each addition only if it is
measured better. TPE alone does not: it finds the big levers one at a time and seldom combines
them within a small budget. So a study run with ``strategy="staged"`` goes through three phases:

* **Recipe.** Right after the baseline, the levers the machine and the data already vouch for
  are measured together, as an engineer would start: padding trimmed with length grouping
  (token sequences), images padded to fewer shapes (images of many sizes), autocast (offered
  only where the device has 16-bit units) and, for throughput, a larger batch (on a CUDA
  device, or for data other than token sequences). Their effects
  multiply, so together they are the predicted best of those levers; when it pays, the search
  builds on it at once instead of measuring each alone first. On a measured table of real
  MiniLM text (108 configurations with compile and ONNX Runtime) it reaches 95% of the optimum
  in 4 trials, where screening each lever alone first took 7.
* **Screen.** Each *lever* (the knobs that form one idea: autocast, trimmed padding with
  length grouping, ``torch.compile``, ONNX Runtime int8, a larger batch, fewer threads, ...)
  is measured alone at its most promising value. A lever whose first value cannot run or
  fails the guard is screened at its next value. The costly ones (a compile, an export, int8)
  wait for the cheap ones, and when one of those paid they are built once, last, on the best
  cheap composition instead.
* **Compose.** The levers that paid are combined greedily onto the best start (the recipe
  when it paid and beats every lever alone, else the largest lever), largest measured effect
  first, keeping each addition only if measured better. Combinations the space knows cannot
  run (autocast with CPU int8) are not proposed. When the recipe paid, only the levers outside
  it are screened (alone) before composing, and each of the recipe's levers is taken back out
  once around the best (an ablation): one that costs inside the recipe is found that way.
* **Refine.** The study's TPE sampler proposes the rest, and it has seen every trial measured
  so far. For speed, the kind of build (compile, runtime, int8, pruning: :data:`HELD`) stays
  the fastest configuration's: the sampler varies the cheap knobs around it.

A value that screening measured clearly slower than the baseline (one thread on two cores,
bfloat16 emulated) is *left out* for the rest of the study: a sampled configuration holding it
is refused before it runs, with the reason ``left out after screening: measured 0.50x``.

Nothing here keeps state of its own: the next configurations are derived from the study's
trials every time, so a resumed study, or several workers sharing one, continue where the
study stands, and a configuration already measured, running or queued is never queued again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.config import Config
from autotune.errors import ConfigError
from autotune.knobs import REGISTRY, declared
from autotune.record import trial_record
from autotune.search.cost import HEAVY_KNOBS, build_s, is_costly, kind_label
from autotune.search.history import by_gain
from autotune.search.levers import Lever, fed, levers, size_levers, workers_again  # Lever...: re-exported
from autotune.search.screen import HARMFUL, MIN_GAIN, Screening, _beside, is_heavy
from autotune.search.storage import withdraw_twins

__all__ = ["STRATEGIES", "Lever", "Staged", "check_strategy", "levers", "queue_next", "size_levers"]

STRATEGIES = ("staged", "tpe")
# What kind of build a configuration is (a compile, an export to another runtime, a calibration,
# a pruning): held at the best's values while the sampler refines (see Staged.held).
HELD = (*HEAVY_KNOBS, *(n for n in declared("held") if n not in HEAVY_KNOBS))


def check_strategy(name: Any) -> str:
    """Return ``name`` if it is a known strategy.

    Raises:
        ConfigError: it is not one of :data:`STRATEGIES`.
    """
    if name not in STRATEGIES:
        raise ConfigError(f"No strategy named {name!r}. Known: {', '.join(STRATEGIES)}.")
    return name


class Staged(Screening):
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

    # ---- what the records say -------------------------------------------------------------

    def left_out(self, records: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], float]]:
        """The changes screening measured clearly slower than the baseline, with their ratio."""
        return self._alone_harmful(records) + self.composition(records)[1]

    def held(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The costly knobs (:data:`HELD`) refinement keeps at the fastest measured configuration's
        values, for speed objectives; TPE proposes the rest around them. A costly build is tried
        on the best cheap composition, not on each variant of it: on pre-padded real text the
        sampler's static and max-autotune compiles of batch and padding variants took 28-60 s
        each, and none came near the best. Of the configurations within :data:`MIN_GAIN` of the
        fastest, the one quickest to build sets them: a frozen compile 0.5% faster than the eager
        best made every refinement trial a 50-s compile."""
        if self.key not in ("samples_per_s", "latency_ms_p95"):
            return {}
        scores = self._scores(records)
        scored = [r for r in records if "config" in r and scores.get(r.get("key", "")) is not None]
        if not scored:
            return {}
        # Around the fastest cheap configuration: its costly build is applied once more where the
        # sampler finds a better one (see _interactions), not built into every trial it proposes.
        config = dict(self._cheap_best(scored, scores)["config"])
        # Only a kind of build the staged phases tried is held: one they never measured (pruning,
        # with throughput first) is left to the sampler, or it could never be tried.
        tried = {n for r in records if "config" in r for n in HELD if r["config"].get(n) != self.baseline.get(n)}
        return {n: config[n] for n in self.space.searched if n in tried and REGISTRY[n].applies(config)}

    def _costly(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The kind of build ``config`` is beyond the baseline's (its :data:`HELD` knobs that
        differ), but what ``fix`` pins: a compile fixed on is every configuration's."""
        base = self._full({})
        return {n: config[n] for n in HELD if n in config and config[n] != base.get(n)}

    def _cheap_best(self, ranked: Sequence[Mapping[str, Any]], scores: Mapping[str, Any]) -> Mapping[str, Any]:
        """The quickest of the fastest configurations that cost no build of their own (none of
        :data:`~autotune.search.cost.HEAVY_KNOBS` set), or of all where none was measured."""
        cheap = [r for r in ranked if not is_costly(r["config"], self._full({}))]
        return _quickest_best(cheap or ranked, scores)

    def refusal(self, config: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> str | None:
        """Why ``config`` is not run (it holds a value left out after screening), or ``None``."""
        return self._refuse(config, self.left_out(records))

    # ---- what to measure next -------------------------------------------------------------

    def composition(
        self, records: Sequence[Mapping[str, Any]], first_tier_only: bool = False, afford: Any = None
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
        halved the model once the decoded-sample cache removed the decoding. The costly builds
        (compile, int8, another runtime) come last, once each, on the best cheap composition.
        ``afford`` (under a deadline, see :meth:`~autotune.search.limits._Limits.afford`): where
        the batch's next step and those builds do not all fit in the time left, the builds go
        first and the batch is climbed after them.
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
        first = [self._onward(c) for _, cs in paid[1:] for c in cs if c not in held] + [
            list(lever.variants) for lever in self.levers if lever.name in on_recipe
        ]
        # The costly levers screening left for the composition (a cheap lever paid).
        first += [list(lever.variants) for lever in self.deferred(records) if lever.name not in on_recipe]
        # Cheap changes first (data shape, precision, then batch, threads, loader: seconds each);
        # a costly build (compile, int8, another runtime) is tried once, on the best cheap
        # composition. Real text: the second tier tried on a compiled composition took 20-50 s a
        # trial, each a compile (from the cache at best), against 10 s eager.
        heavy = self._by_gain([steps for steps in first if is_heavy(steps)], current, held, scores, afford)
        first = [steps for steps in first if steps not in heavy]
        # The recipe's own levers (its batch) are not tried again on what was built on it.
        inside = {lever.name for lever in self.recipe_levers} if recipe_ratio is not None else set()
        second = [
            list(lever.variants)
            for lever in self.levers
            if not first_tier_only and lever.name not in self.tier1 and lever.name not in inside
        ]
        for tier, steps in enumerate((first, second, heavy)):
            if tier == 2 and steps and recipe_ratio is not None and first_tier_only:
                # The batch is climbed before a costly build; under a deadline, where both fit (a 3-minute
                # budget of real MiniLM climbed to 256 for +10%, never built OpenVINO bf16: 1.5x).
                climb = self._interactions(records, scores, self._alone_harmful(records) + harmful, batch_only=True)
                builds = [] if afford is None else self._builds(steps, current, held, scores)
                if climb is not None and (afford is None or afford([climb, *builds])):
                    return climb, harmful
            if tier and recipe_ratio is not None:
                # The batch around a recipe was climbed before screening: the costly builds and
                # the second tier go on the fastest configuration holding the rest of what was kept.
                current, held = self._climbed(records, scores, current, held)
            for variants in steps:
                for changes in variants:  # the next variant only while none before it was kept
                    changes = self._symbols(changes, current)
                    candidate, taking = self._add(current, held, changes), [*held, changes]
                    if candidate is None and tier == 2:  # a costly build may replace what it masks
                        candidate, taking = self._replace(current, held, changes)
                    if candidate is None or Config(candidate).key() == Config(current).key():
                        continue
                    key, now = Config(candidate).key(), scores.get(Config(current).key())
                    if key not in scores:
                        return candidate, harmful
                    if scores[key] is not None and now and scores[key] / now < HARMFUL:
                        harmful.append((_beside(changes, candidate), scores[key] / now))
                    if (scores[key] or 0.0) >= MIN_GAIN * (now or 0.0):
                        current, held = candidate, taking
                        break
                    if tier == 2 and "compile_mode" in changes and scores[key] is not None:
                        # A compile that ran and did not pay: its other modes are not built too
                        # (real text: default ran 1.00x in 67 s, then freezing 1.00x in 55 s).
                        break
        left_out = self._alone_harmful(records) + harmful
        return self._interactions(records, scores, left_out, batch_only=first_tier_only), harmful

    def _by_gain(
        self, steps: list[Any], current: dict[str, Any], held: list[Mapping[str, Any]], scores: Mapping[str, Any],
        afford: Any,
    ) -> list[Any]:  # fmt: skip
        """Under a deadline (``afford`` prices), the costly levers ``steps`` by expected gain per
        second (:func:`~autotune.search.history.by_gain`): each variant priced by ``afford.cost``,
        its gain what the runs before measured of its kind (``afford.past``); else as they are.
        A 90-s budget of real MiniLM after a 16-trial run queued the compile first (priced 59 s)
        and built nothing; with the run before's figures (OpenVINO int8 1.43x the best plain
        configuration for 1 s more than a plain trial, the compile 1.07x for 16 s) it built the
        int8 right after the recipe's ablations, 7 s, and ended at 0.94 of the 16-trial winner."""

        if not hasattr(afford, "cost"):
            return steps
        base = self._full({})
        return by_gain(steps, lambda variants: [self._unmeasured(v, current, held, scores) for v in variants],
                       afford.cost, lambda c: afford.past.get(kind_label(c, base), {}).get("ratio"))  # fmt: skip

    def _climbed(
        self,
        records: Sequence[Mapping[str, Any]],
        scores: Mapping[str, Any],
        current: dict[str, Any],
        held: list[Mapping[str, Any]],
    ) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
        """``current`` moved to the fastest measured configuration that holds every change in
        ``held`` but the batch size (the batch neighbours measured around it), with the batch
        left out of ``held``; as it was when none is faster. Only configurations without a costly
        build of their own: the cheap levers are tried on the cheap composition, not compiled."""
        held = [{k: v for k, v in c.items() if k != "batch_size"} for c in held]
        held = [c for c in held if c]
        best, now = current, scores.get(Config(current).key()) or 0.0
        for r in records:
            score = scores.get(r.get("key", ""))
            costly = "config" in r and is_costly(r["config"], self._full({}))
            if costly or "config" not in r or score is None or score <= now:
                continue
            if all(self._keeps(r["config"], c) for c in held):
                best, now = dict(r["config"]), score
        return best, held

    def _interactions(
        self,
        records: Sequence[Mapping[str, Any]],
        scores: Mapping[str, Any],
        left_out: list,
        batch_only: bool = False,
        own_only: bool = False,
    ) -> Any:
        """Around the best configuration measured so far, the first untried of: CUDA graphs
        (``reduce-overhead``) where its trial was launch-bound, the batch size
        one step larger (the batch interacts with everything), each first-tier lever that did
        not pay at the baseline's batch, at the best's, the batch size one step smaller, and
        shapes as symbols when it compiles trimmed padding. ``own_only``: only the batch
        neighbours of a leading runtime (:meth:`_own_batches`)."""
        ranked = [r for r in records if r.get("key") in scores and scores[r["key"]] is not None and "config" in r]
        if not ranked:
            return None
        top = _quickest_best(ranked, scores)
        # The cheap knobs are varied around the fastest configuration that builds in seconds; a
        # costly build (a compile) of the fastest is applied once more to a better one. On real
        # text, the batch neighbours and refinement trials of a compiled best were each a compile
        # (13-49 s, 217 s in all) and none came near it.
        cheap = self._cheap_best(ranked, scores)
        best = dict(cheap["config"])
        costly = self._costly(top["config"])
        # Applied again only where the cheap configuration beats, beyond the noise, the one it was
        # built on (real text: a batch of 16 within 1% of 32 was compiled again, 21 s for nothing).
        under = scores.get(Config(self._full({n: self._full({})[n] for n in costly}, top["config"])).key())
        moved = under is None or (scores.get(cheap.get("key", "")) or 0.0) >= MIN_GAIN * under
        lift = [costly] if moved and is_costly(costly, self._full({})) else []
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
        top_config = dict(top["config"])
        own = self._own_batches(ranked, cheap, scores)
        dynamic = [{"compile_dynamic": True}] if top_config.get("padding", "as_given") != "as_given" else []
        # The model alone said the host's kernel launches bound it (small batches, small models):
        # CUDA graphs replay the launches, first thing around the best. Also where the best still
        # waits for its input with the feed's levers on: the launches then sit on the host thread
        # that feeds the device, and the graphs take them off it.
        bound = top.get("bound")
        graphs = [{"compile_mode": "reduce-overhead"}] if bound == "launch-bound" or (
            bound == "input-bound" and self.device.startswith("cuda") and fed(top_config)
        ) else []  # fmt: skip
        # Each of the recipe's levers (but the batch, which the neighbours cover) taken back out of
        # the best, when the recipe paid: measured only together, one of them may cost inside it.
        ablations = []
        if self._recipe_paid(scores) is not None:
            for lever, part in zip(self.recipe_levers, self.recipe_parts, strict=True):
                if lever.name != "batch_size" and self._keeps(best, part):
                    ablations.append(self._without(part))
        around = [*((c, top_config) for c in graphs), *workers_again(self, top_config, costly), *own]
        around += [(c, best) for c in (*larger, *again, *smaller, *ablations)]
        moves = [(c, best) for c in (*larger, *smaller)] if batch_only else [
            *around, *((c, top_config) for c in dynamic), *((c, best) for c in lift)
        ]  # fmt: skip
        if own_only:
            moves = list(own)
        for changes, base in moves:
            candidate = self._full(changes, base)
            key = Config(candidate).key()
            if self._keeps(candidate, changes) and self.runnable(candidate) and key not in scores:
                if self._refuse(candidate, left_out) is None:
                    return candidate
        return None

    def next_configs(
        self, records: Sequence[Mapping[str, Any]], n_trials: int, afford: Any = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """The phase the study is in and what to queue for it: the screening configurations
        left, else the next composition, else nothing (``"refine"``: TPE proposes). ``afford``:
        see :meth:`composition`."""
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
            composed, harmful = self.composition(records, first_tier_only=True, afford=afford)
            if composed is not None:
                return "compose", [composed]
            # A costly build that leads has a best batch of its own: its neighbours are measured
            # before the second tier (threads, loader workers: at 0.4-0.5x on two cores), which a
            # 3-minute budget on real text spent its last trials on instead (OpenVINO bf16 ran
            # 5% faster at 32 than at the 64 the torch composition had chosen within the noise).
            own = self._interactions(records, scores, self._alone_harmful(records) + harmful, own_only=True)
            if own is not None:
                return "compose", [own]
            skip = [lever.name for lever in self.recipe_levers] + self._on_recipe(scores)
        screen = self.screening(records, n_trials, skip)
        if screen:
            return "screen", screen
        composed, _ = self.composition(records)
        return ("compose", [composed]) if composed is not None else ("refine", [])


def _quickest_best(ranked: Sequence[Mapping[str, Any]], scores: Mapping[str, Any]) -> Mapping[str, Any]:
    """Of the records within :data:`MIN_GAIN` of the best score (a tie within the noise), the
    one quickest to build: what the next trials are built around.

    Example:
        >>> eager = {"key": "a", "compile_s": 0.4}
        >>> frozen = {"key": "b", "compile_s": 45.0}
        >>> _quickest_best([eager, frozen], {"a": 205.6, "b": 206.6})["key"]
        'a'
        >>> _quickest_best([eager, frozen], {"a": 180.0, "b": 206.6})["key"]
        'b'
    """
    top = max(scores[r["key"]] for r in ranked)
    near = [r for r in ranked if scores[r["key"]] * MIN_GAIN >= top]
    return min(near, key=lambda r: (build_s(r), -scores[r["key"]]))


def queue_next(study: Any, strategy: Staged, n_trials: int, limits: Any = None, room: int | None = None) -> str:
    """Queue in ``study`` what ``strategy`` says comes next and is not measured, running or
    queued already (by this worker or another); return the phase. ``limits``: the search's
    deadline, which orders the composition by what fits in the time left. ``room``: the trials
    the budget has left (not counting those queued): no more than that is queued, so a run
    that ends at its ``n_trials`` leaves no trial "queued, not started" behind it (a resumed
    run queues the rest again from the records).

    Every worker calls this before it asks for a trial, so the phases advance from the study's
    records alone. Two workers that queue the same configuration at the same moment still
    measure it once: the study loop's claim on its key lets only one of them run it.
    """
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    records = [trial_record(t) for t in trials if t.state.is_finished() and "status" in t.user_attrs]
    known = {r["key"] for r in records if "key" in r and r["status"] not in ("skipped", "interrupted")}
    known |= {t.user_attrs["key"] for t in trials if t.state == TrialState.RUNNING and "key" in t.user_attrs}
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    for t in waiting:
        if "fixed_params" in t.system_attrs and not t.user_attrs.get("held"):
            known.add(Config(strategy._full(t.system_attrs["fixed_params"])).key())
    phase, configs = strategy.next_configs(records, n_trials, limits.afford(records) if limits else None)
    free = None if room is None else room - len(waiting)
    if phase == "refine" and not waiting:
        # The sampler proposes the knobs not held (Optuna samples what a queued trial leaves out).
        held = strategy.held(records)
        if held:
            study.enqueue_trial(held, user_attrs={"phase": "refine", "held": True})
    for config in configs:
        key = Config(config).key()
        if key in known:
            continue
        if free is not None and (free := free - 1) < 0:
            break
        known.add(key)
        params = {n: config[n] for n in strategy.space.searched if REGISTRY[n].applies(config)}
        study.enqueue_trial(params, user_attrs={"phase": phase, "queued_key": key}, skip_if_exists=True)
    if configs:
        withdraw_twins(study)
    return phase
