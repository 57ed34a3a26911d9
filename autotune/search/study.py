"""Optuna wiring: sampler, storage, the baseline enqueued first, the guard as a constraint,
duplicates answered from earlier measurements, out-of-memory rules, budget and resume, for one
worker or many sharing the study through its storage.

Every trial's result is stored in the study the moment it is known, as user attributes:
``config``, ``key``, ``status``, ``kind``, ``reason``, the metrics and who measured it
(``hardware``, ``worker``). Nothing else keeps state, so an interrupted study resumes from its
storage alone, and workers on other machines coordinate through it alone:

* A worker *claims* a configuration by writing its ``key`` on its RUNNING trial, then reads the
  study. It measures only if no other trial holds or has measured that key, and the measured
  trials plus the claims in flight leave room in ``n_trials``. Every claim is written before it
  is judged, so of two claims that overlap the later judge sees the earlier: a key is never
  measured twice and the budget is never overrun. The lower trial number has priority; a claim
  waits a moment for younger claims that may withdraw, never for older ones, so nobody waits
  in a circle.
* A worker that dies stops its trial's heartbeat; after the grace period the next worker that
  looks marks the trial FAIL and Optuna's retry callback queues its configuration once more
  (the new trial's ``retry_of`` names the dead one).
"""

from __future__ import annotations

import math
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import Config
from autotune.errors import ConfigError, TrialError
from autotune.knobs import REGISTRY
from autotune.search.cost import HEAVY_KNOBS, trial_cost_s
from autotune.search.select import OBJECTIVES, check_objectives
from autotune.search.space import SearchSpace, first_params
from autotune.search.storage import (
    DEFAULT_GRACE_S,
    DEFAULT_HEARTBEAT_S,
    fail_stale,
    family,
    heartbeat,
    open_group,
    open_storage,
)
from autotune.search.storage import redact as _redact
from autotune.trial.runner import Runner
from autotune.trial.spec import TrialResult

__all__ = ["make_sampler", "open_study", "run_trials", "trial_fidelity", "trial_limit", "trial_record"]

# Knobs whose values change how much memory a batch needs.
_MEMORY_KNOBS = ("amp_dtype", "compile_mode", "channels_last")
# After this many suggestions in a row that were all measured (or held) before, the space is spent.
_MAX_REPEATS = 30
# Statuses that say nothing about a configuration: it may be measured again.
_NO_RESULT = ("skipped", "interrupted")
# This many trials in a row not started for the deadline end the search ("timeout"): the staged
# strategy moves on to cheaper levers after each, and a sampler proposing only costly ones
# would otherwise never stop before the deadline.
_MAX_LATE = 30


def _has_result(attrs: Mapping[str, Any]) -> bool:
    """Whether a finished trial holds a result for its configuration: not a skipped or
    interrupted claim, nor one not started for the deadline (a resumed run measures it)."""
    if attrs.get("status", "skipped") in _NO_RESULT:
        return False
    return not (attrs.get("kind") == "deadline" and not attrs.get("ran"))


# A worker waiting for others (the budget spoken for) looks at the study again this often.
_POLL_S = 0.5
# How long a claim waits for younger claims on the same key or budget slot to withdraw.
_CLAIM_WAIT_S = 5.0
# The adaptive per-trial timeout: a multiple of the baseline trial's wall time, with a floor,
# plus an allowance for configurations that compile, quantize, prune or convert the model.
TIMEOUT_FLOOR_S = 30.0
TIMEOUT_FACTOR = 10.0
COMPILE_ALLOWANCE_S = 120.0
# Before the baseline has run nothing is known: its own limit.
FIRST_TRIAL_TIMEOUT_S = 600.0
_HEAVY_KNOBS = HEAVY_KNOBS


def trial_limit(config: Mapping[str, Any], baseline: Mapping[str, Any] | None, fixed: float | None) -> float:
    """Seconds one trial of ``config`` may take: ``fixed`` when the user set ``trial_timeout``,
    else adaptive: ``max(30 s, 10 x the baseline trial's wall time)``, plus 120 s when
    ``config`` compiles, quantizes, prunes or changes the runtime; 600 s for the baseline itself.

    Example:
        >>> trial_limit({"compile_mode": "none"}, {"config": {"compile_mode": "none"}, "wall_s": 4.0}, None)
        40.0
        >>> trial_limit({"compile_mode": "default"}, {"config": {"compile_mode": "none"}, "wall_s": 1.0}, None)
        150.0
    """
    if fixed is not None:
        return float(fixed)
    if baseline is None:
        return FIRST_TRIAL_TIMEOUT_S
    wall = baseline.get("wall_s") or baseline.get("trial_s") or FIRST_TRIAL_TIMEOUT_S / TIMEOUT_FACTOR
    limit = max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * wall)
    base = baseline.get("config") or {}
    if any(config.get(k) != base.get(k) for k in _HEAVY_KNOBS if k in config):
        limit += COMPILE_ALLOWANCE_S
    return limit


def make_sampler(seed: int, parallel: bool = False) -> optuna.samplers.BaseSampler:
    """The default sampler: multivariate TPE after 8 random trials.

    With ``parallel`` (other workers share the study), the constant-liar strategy keeps it
    from proposing configurations next to those other workers are measuring right now.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, group=True, n_startup_trials=8, constant_liar=parallel
        )


def open_study(
    storage: Any,
    study_name: str,
    objectives: Sequence[str],
    seed: int,
    resume: bool,
    sampler: optuna.samplers.BaseSampler | None = None,
    *,
    hardware: str = "unknown",
    env: Mapping[str, Any] | None = None,
    join: bool = False,
    worker: str = "",
    heartbeat_interval_s: int = DEFAULT_HEARTBEAT_S,
    grace_period_s: int = DEFAULT_GRACE_S,
) -> optuna.Study:
    """Open this hardware's study in the family ``study_name``, creating what is missing.

    Args:
        storage: A database URL or a storage from :func:`autotune.search.storage.open_storage`.
        study_name: The study as the user names it; each hardware group has its own Optuna study.
        objectives: What the study optimizes; an existing group must optimize the same.
        seed: Seeds the default sampler; joined workers mix in ``worker`` so they explore apart.
        resume: Continue an existing study.
        sampler: An Optuna sampler instead of the default.
        hardware: :meth:`autotune.env.Env.hardware_key` of the machine that will measure.
        env: The :meth:`~autotune.env.Env.manifest` stamped on a new group.
        join: Share the study with other workers, created by whichever comes first.
        worker: This worker's id (``host:pid[:device]``).
        heartbeat_interval_s: Seconds between heartbeats of a running trial.
        grace_period_s: Seconds of silence after which a trial's worker is taken for dead.

    Raises:
        ConfigError: the study exists and neither ``resume`` nor ``join`` is set, an existing
            group optimizes other objectives, or the storage URL is unusable.
    """
    objectives = check_objectives(objectives)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage if isinstance(storage, str) else storage.url
    if isinstance(storage, str):
        storage = open_storage(storage, heartbeat_interval_s, grace_period_s)
    members = family(storage, study_name)
    n_existing = sum(storage.get_n_trials(storage.get_study_id_from_name(s.study_name)) for s in members)
    if n_existing and not (resume or join):
        raise ConfigError(
            f"Study {study_name!r} already exists in {_redact(url)} with {n_existing} trials. "
            "Pass resume=True (CLI: --resume) to continue it, join=True (--join) to share it with the workers "
            "running it now, or choose another study name or output directory."
        )
    directions = [OBJECTIVES[o][1] for o in objectives]
    attrs = {"env": dict(env or {}), "objectives": list(objectives)}
    name, _ = open_group(storage, study_name, hardware, [_direction(d) for d in directions], attrs)
    if sampler is None:
        sampler = make_sampler(seed ^ zlib.crc32(worker.encode()) if join else seed, parallel=join)
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    found = [d.name.lower() for d in study.directions]
    if found != directions:
        raise ConfigError(
            f"Study {name!r} in {_redact(url)} optimizes {found}, but this run asks for {list(objectives)} "
            f"({directions}). Use the study's objectives or another study name."
        )
    return study


def _direction(name: str) -> optuna.study.StudyDirection:
    return optuna.study.StudyDirection.MAXIMIZE if name == "maximize" else optuna.study.StudyDirection.MINIMIZE


def trial_record(trial: FrozenTrial) -> dict[str, Any]:
    """A trial's stored result as one flat dict."""
    attrs = dict(trial.user_attrs)
    attrs["number"] = trial.number
    attrs["state"] = trial.state.name
    return attrs


def n_measured(study: optuna.Study) -> int:
    """Trials of ``study`` measured so far: what counts against ``n_trials``."""
    return _View(study.get_trials(deepcopy=False), "").n_measured


def _converged(study: optuna.Study, objectives: Sequence[str], strategy: Any) -> bool:
    """Whether the staged search's refinement stopped paying (see
    :func:`autotune.search.phases.converged`); the reason is kept on the study."""
    from autotune.search.phases import converged

    key, direction = OBJECTIVES[objectives[0]][:2]
    why = converged([trial_record(t) for t in _finished(study)], key, direction == "maximize")
    if why is not None:
        study.set_user_attr("converged", why)
    return why is not None


def _finished(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and "status" in t.user_attrs]


class _View:
    """What one read of the study says: results by key, claims in flight, the budget used."""

    def __init__(self, trials: list[FrozenTrial], baseline_key: str) -> None:
        self.results: dict[str, FrozenTrial] = {}  # key -> earliest trial with a result
        self.claims: list[FrozenTrial] = []  # RUNNING trials holding a key
        self.n_measured = 0
        self.baseline_queued = False
        for t in trials:  # in trial-number order
            attrs = t.user_attrs
            if t.state == TrialState.RUNNING and "key" in attrs:
                self.claims.append(t)
            elif t.state in (TrialState.WAITING, TrialState.RUNNING) and attrs.get("baseline"):
                self.baseline_queued = True  # queued, or asked and about to claim
            elif t.state.is_finished() and _has_result(attrs) and "key" in attrs:
                self.results.setdefault(attrs["key"], t)
                self.n_measured += bool(attrs.get("ran") and attrs.get("repeat_of") is None)
        base = self.results.get(baseline_key)
        self.baseline = base
        self.needs_baseline = (
            base is None
            and not self.baseline_queued
            and not any(c.user_attrs["key"] == baseline_key for c in self.claims)
        )

    def raise_if_baseline_failed(self) -> None:
        base = self.baseline
        if base is not None and base.user_attrs.get("ran") and base.user_attrs.get("status") != "ok":
            attrs = base.user_attrs
            raise TrialError(
                attrs.get("kind") or attrs["status"],
                f"The baseline (the model as given) failed in trial {base.number}, so nothing can be compared "
                f"with it: {attrs['status']}: {attrs.get('reason')}. Fix the model (or raise trial_timeout if "
                "it is just slow) and start a new study: another --study name or --out directory.",
            )


def _suggest(trial: optuna.Trial, space: SearchSpace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name, knob in REGISTRY.items():
        values = space.values[name]
        if not knob.applies(config):
            config[name] = space.baseline[name]
        elif len(values) == 1:
            config[name] = values[0]
        else:
            try:
                config[name] = trial.suggest_categorical(name, values)
            except ValueError as exc:
                # Optuna keeps each parameter's choices fixed for the life of a study.
                raise ConfigError(
                    f"Knob {name!r} has other candidates ({', '.join(map(str, values))}) than when this study "
                    "began, and a study's search space cannot change. Resume with the same space and fixes, or "
                    "start a new study (another --study name or --out directory)."
                ) from exc
    return config


def _oom_rule(config: dict[str, Any], trials: list[FrozenTrial]) -> str | None:
    for t in trials:
        if t.user_attrs.get("status") != "oom" or t.user_attrs.get("kind") != "oom":
            continue
        other = t.user_attrs.get("config", {})
        if all(other.get(k) == config.get(k) for k in _MEMORY_KNOBS) and config["batch_size"] >= other.get(
            "batch_size", math.inf
        ):
            same = ", ".join(f"{k}={config[k]}" for k in _MEMORY_KNOBS)
            return (
                f"not run: batch_size {config['batch_size']} >= {other['batch_size']}, which ran out of memory "
                f"in trial {t.number} with the same {same}"
            )
    return None


# The knobs that decide which code runs. A configuration that failed with the same values of all
# of them twice (TorchScript of a statically quantized graph, say) fails again whatever its
# batch size, loader or threads: later ones are not run, as the sampler does not learn from
# failed trials and would spend the budget on them.
_CODE_KNOBS = (
    "runtime",
    "quantization",
    "int8_fallback",
    "int8_per_channel",
    "compile_mode",
    "compile_dynamic",
    "ort_precision",
    "prune_method",
    "amp_dtype",
    "padding",
)
# The path's own knobs, without the values that change only which layers or how many tokens it
# takes: three failures on the same path (with any padding or int8 fallback) rule it out too.
# Measured: a text search spent 30 of 55 trials on TorchScript of static int8, every one failing,
# across 5 paddings and 3 fallback values.
_PATH_KNOBS = tuple(k for k in _CODE_KNOBS if k not in ("int8_fallback", "int8_per_channel", "padding"))


# What the configuration itself caused: the sampler should learn from it. (Not what befell the
# trial: a skipped claim, an interruption, a dead worker's retry.)
_BAD_CONFIG = frozenset({"error", "oom", "timeout", "crash", "infeasible"})


# A screening trial times this share of the windows: it only has to tell a lever that pays
# from one that does not; the finalists are timed again in selection rounds anyway.
SCREEN_SHARE = 0.5


def trial_fidelity(
    phase: str | None,
    baseline: bool,
    objectives: Sequence[str],
    finished: Sequence[FrozenTrial],
    space: SearchSpace | None = None,
) -> dict[str, Any]:
    """How fully a trial is timed (multi-fidelity): a screening trial gets :data:`SCREEN_SHARE`
    of the windows; with throughput first, any trial but the baseline gets the ``best``
    samples/s measured so far, and stops early (once a few batches are timed) if it runs under the timing
    settings' ``stop_share`` of it. Only trials that can win set the best: with ``space``, those
    it contains (not the model as given where ``fix`` pins a knob elsewhere, or the one
    candidate holding the fixed value would be stopped and none would be left).

    Example:
        >>> trial_fidelity("screen", False, ["latency"], [])
        {'share': 0.5}
        >>> trial_fidelity(None, True, ["throughput"], [])
        {}
    """
    fidelity: dict[str, Any] = {"share": SCREEN_SHARE} if phase == "screen" else {}
    if baseline or not objectives or objectives[0] != "throughput":
        return fidelity
    speeds = [
        t.user_attrs.get("samples_per_s")
        for t in finished
        if t.user_attrs.get("status") == "ok" and (space is None or space.contains(t.user_attrs.get("config") or {}))
    ]
    best = max((float(v) for v in speeds if v), default=None)
    if best:
        fidelity["best"] = best
    return fidelity


def _fault_rule(config: dict[str, Any], trials: list[FrozenTrial]) -> str | None:
    failed = [
        t
        for t in trials
        if t.user_attrs.get("status") == "error" and t.user_attrs.get("kind") in ("runtime", "compile")
    ]
    for knobs, times in ((_CODE_KNOBS, 2), (_PATH_KNOBS, 3)):
        same = [t for t in failed if all(t.user_attrs.get("config", {}).get(k) == config.get(k) for k in knobs)]
        if len(same) >= times:
            values = ", ".join(f"{k}={config.get(k)}" for k in knobs)
            numbers = ", ".join(str(t.number) for t in same[:times])
            return (
                f"not run: trials {numbers} failed ({same[0].user_attrs['kind']}) with the same {values}; "
                "it fails whatever the batch size, loader or threads"
            )
    return None


def _tell(
    study: optuna.Study,
    trial: optuna.Trial,
    outcome: TrialResult,
    objectives: list[str],
    max_drop: float,
    written: Mapping[str, Any] | None = None,
) -> FrozenTrial:
    """Store ``outcome`` as user attributes (but those in ``written``, stored already) and tell."""
    drop = outcome.metrics.get("metric_drop", 0.0)
    if outcome.ok and drop > max_drop + 1e-12:
        outcome.fail("infeasible", "guard", f"metric dropped by {drop:.4g}, more than max_metric_drop={max_drop:g}")
    result = outcome.to_attrs()
    written = written or {}
    for key, value in result.items():
        if key not in written or written[key] != value:  # each attribute is one database commit
            trial.set_user_attr(key, value)
    keys = [OBJECTIVES[o][0] for o in objectives]
    if result["status"] in ("ok", "infeasible") and all(k in result for k in keys):
        trial.set_constraint(
            "metric_drop", result.get("metric_drop", 1.0) - max_drop if result["status"] == "ok" else 1.0
        )
        return _told(study, trial, [float(result[k]) for k in keys])
    if result["status"] == "stopped" or (result["status"] in _BAD_CONFIG and result.get("kind") != "deadline"):
        # Told as pruned, not failed: TPE ignores failed trials, so it kept proposing the same
        # failing code path (measured: 250 of 300 proposals of a text search were TorchScript of
        # static int8, every one ruled out), while pruned ones count against their region. An
        # infeasible trial with its measurements was told above, as a constraint violation. A
        # trial stopped early (far below the best) is what Optuna calls pruned.
        return _told(study, trial, state=TrialState.PRUNED)
    return _told(study, trial, state=TrialState.FAIL)


def _told(study: optuna.Study, trial: optuna.Trial, *args: Any, **kwargs: Any) -> FrozenTrial:
    """``study.tell``, where a sampler may stop the study as it would inside ``Study.optimize``
    (a grid sampler with every point visited calls ``study.stop()``, which raises outside
    it); :func:`run_trials` then ends with ``"exhausted"``."""
    local = study._thread_local
    inside = getattr(local, "in_optimize_loop", False)
    local.in_optimize_loop = True
    try:
        return study.tell(trial, *args, **kwargs)
    finally:
        local.in_optimize_loop = inside


def _stopped(study: optuna.Study) -> bool:
    """Whether the sampler stopped the study (:func:`_told`); the flag is cleared for a next run."""
    stopped = bool(getattr(study, "_stop_flag", False))
    study._stop_flag = False
    return stopped


def _claim(study: optuna.Study, me: int, key: str, n_trials: int, baseline_key: str) -> tuple[str, Any]:
    """Judge trial ``me``'s claim on ``key``; see the module docstring.

    Returns:
        ``("measure", None)``, ``("repeat", earlier trial)``, ``("duplicate", trial holding the
        key)`` or ``("budget", None)``.
    """
    deadline = time.monotonic() + _CLAIM_WAIT_S
    while True:
        view = _View(study.get_trials(deepcopy=False), baseline_key)
        if key in view.results:
            return "repeat", view.results[key]
        others = [t for t in view.claims if t.number != me]
        # Older claims, and younger ones that already decided to measure, stand; the rest may withdraw.
        firm = [t for t in others if t.number < me or t.user_attrs.get("measuring")]
        same = [t for t in others if t.user_attrs["key"] == key]
        holder = next((t for t in same if t.number < me or t.user_attrs.get("measuring")), None)
        if holder is not None:
            return "duplicate", holder
        if view.n_measured + len(firm) + 1 > n_trials:
            return "budget", None
        if not same and view.n_measured + len(others) + 1 <= n_trials:
            return "measure", None
        if time.monotonic() >= deadline:
            return ("duplicate", same[0]) if same else ("budget", None)
        time.sleep(0.05)


def run_trials(
    study: optuna.Study,
    runner: Runner,
    space: SearchSpace,
    *,
    n_trials: int,
    timeout: float | None,
    max_metric_drop: float,
    objectives: Sequence[str],
    extra_attrs: dict[str, Any],
    on_trial: Callable[[dict[str, Any], int], None] | None = None,
    stop: threading.Event | None = None,
    trial_timeout: float | None = None,
    strategy: Any = None,
    reserve: Callable[[list[dict[str, Any]]], float] | None = None,
) -> str:
    """Measure trials until ``n_trials`` have been measured in the study, counting every
    worker's (and, on resume, the earlier ones), ``timeout`` seconds pass, or the space is spent.

    Args:
        stop: Set (by Ctrl-C or another thread) to end this loop with :class:`KeyboardInterrupt`
            before the next trial; a trial whose worker was killed to stop is marked
            ``interrupted``.
        trial_timeout: Seconds one trial may take; ``None`` for the adaptive limit of
            :func:`trial_limit`. A trial still running at the ``timeout`` deadline is stopped
            then and recorded with kind ``deadline``.
        strategy: A :class:`autotune.search.strategy.Staged` that queues the screening and
            composing trials and refuses values screening left out; ``None`` for plain TPE
            after the warm start of :func:`autotune.search.space.warm_start`.
        reserve: With a ``timeout``: the seconds before its end the search leaves free (for
            the run's finish), given the trials' records so far. A trial whose predicted cost
            (:func:`autotune.search.cost.trial_cost_s`) does not fit in what is left is not
            started (recorded with kind ``deadline``); the search stops once not even the
            baseline's cost fits.

    Returns:
        Why the loop stopped: ``"budget"``, ``"timeout"``, ``"exhausted"`` or, with the staged
        strategy, ``"converged"`` (refinement stopped improving: see
        :func:`autotune.search.phases.converged`; the reason is the study's ``converged`` attribute).

    Raises:
        TrialError: the baseline failed (here or in another worker).
    """
    objectives = check_objectives(objectives)
    baseline_key = Config(dict(space.baseline)).key()
    study.set_user_attr("n_trials", n_trials)  # for `autotune status`: the budget last asked for
    deadline = None if timeout is None else time.monotonic() + timeout
    limits = _Limits(runner, trial_timeout, deadline, timeout, reserve)
    repeats = late = 0
    waiting: set[int] = set()
    while True:
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        if limits.out_of_time(study):
            return "timeout"
        if strategy is not None and _converged(study, objectives, strategy):
            return "converged"
        if repeats >= _MAX_REPEATS or _stopped(study):
            return "exhausted"
        fail_stale(study)
        view = _View(study.get_trials(deepcopy=False), baseline_key)
        view.raise_if_baseline_failed()
        limits.learn(view.baseline)
        if view.n_measured >= n_trials:
            return "budget"
        if view.n_measured + len(view.claims) >= n_trials:
            # The rest of the budget is being measured; a dead worker's claim is freed after the grace period.
            waiting = _say_waiting(view.claims, waiting, study)
            time.sleep(_POLL_S)
            continue
        if view.needs_baseline:
            baseline, *warm = first_params(space)
            study.enqueue_trial(baseline, user_attrs={"baseline": True}, skip_if_exists=True)
            if (
                strategy is None and not view.n_measured
            ):  # a fresh study: the usual first changes next, within the budget
                for params in warm[: max(0, n_trials - 1)]:
                    study.enqueue_trial(params, skip_if_exists=True)
        elif strategy is not None and view.baseline is not None:
            from autotune.search.strategy import queue_next

            queue_next(study, strategy, n_trials)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            trial = study.ask()
        with heartbeat(study, trial):
            try:
                outcome = _one_trial(
                    study,
                    trial,
                    runner,
                    space,
                    objectives,
                    max_metric_drop,
                    extra_attrs,
                    n_trials,
                    on_trial,
                    stop,
                    limits,
                    strategy,
                )
            except optuna.exceptions.UpdateFinishedTrialError:
                # Declared dead while alive (the database out of reach longer than the grace
                # period): its retry measures the configuration again.
                warnings.warn(
                    f"Trial {trial.number} was marked failed by another worker (no heartbeat for the grace "
                    "period); its result is dropped and its retry will measure it again.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            except BaseException:
                # Ctrl-C or an error between ask and tell: no trial is left RUNNING in the storage.
                if study.trials[trial.number].state == TrialState.RUNNING:
                    trial.set_user_attr("status", "interrupted")
                    study.tell(trial, state=TrialState.FAIL)
                raise
        late = late + 1 if outcome == "late" else 0
        if late >= _MAX_LATE:  # nothing proposed fits in what is left: the deadline ended it
            return "timeout"
        # A refusal of a value left out after screening costs no budget: many in a row, the space is spent.
        repeats = repeats + 1 if outcome in ("repeat", "duplicate", "screened") else 0


class _Limits:
    """Each trial's time limit: adaptive (or the user's), and never past the search's deadline:
    the study's, less the ``reserve`` the run keeps for its finish."""

    def __init__(
        self,
        runner: Runner,
        fixed: float | None,
        deadline: float | None,
        timeout: float | None,
        reserve: Callable[[list[dict[str, Any]]], float] | None = None,
    ) -> None:
        self.runner, self.fixed, self.deadline, self.timeout = runner, fixed, deadline, timeout
        self.reserve = reserve
        self.baseline: dict[str, Any] | None = None

    def learn(self, baseline: FrozenTrial | None) -> None:
        """Take the baseline's wall time once it is measured; the runner's calls (the rounds,
        the export) then get the limit of a compiling configuration per unit of work."""
        if self.baseline is not None or baseline is None or baseline.user_attrs.get("status") != "ok":
            return
        self.baseline = dict(baseline.user_attrs)
        heavy = {k: f"{self.baseline['config'].get(k)}-other" for k in _HEAVY_KNOBS}
        self.runner.timeout = trial_limit(heavy, self.baseline, self.fixed)

    def _left(self, records: list[dict[str, Any]]) -> float | None:
        """Seconds the search has left (the finish's reserve taken off), ``None`` without a deadline."""
        if self.deadline is None:
            return None
        kept = self.reserve(records) if self.reserve is not None and self.baseline is not None else 0.0
        return self.deadline - kept - time.monotonic()

    def out_of_time(self, study: optuna.Study) -> bool:
        """Whether the search must stop: its deadline passed, or not even a trial as cheap as
        the baseline would finish before it."""
        records = [trial_record(t) for t in _finished(study)] if self.deadline is not None else []
        left = self._left(records)
        if left is None:
            return False
        cheapest = float(self.baseline.get("wall_s") or 0.0) if self.baseline else 0.0
        return left <= 0 or left < cheapest

    def too_late(self, config: Mapping[str, Any], finished: list[FrozenTrial]) -> str | None:
        """Why a trial of ``config`` is not started (its predicted cost exceeds what the search
        has left), or ``None``."""
        if self.deadline is None or self.baseline is None:
            return None
        records = [trial_record(t) for t in finished]
        left = self._left(records)
        cost = trial_cost_s(config, records, self.baseline)
        if left is None or cost <= left:
            return None
        return (
            f"not started: it would take about {cost:.0f} s (predicted from the trials measured) and the search "
            f"had {max(left, 0.0):.0f} s left before the run's deadline"
        )

    def for_config(self, config: Mapping[str, Any], finished: list[FrozenTrial]) -> tuple[float, bool]:
        """(seconds, whether the search's deadline is what limits them): a trial that runs past
        its predicted cost is stopped where the finish's reserve begins, not after eating it."""
        limit = trial_limit(config, self.baseline, self.fixed)
        left = self._left([trial_record(t) for t in finished]) if self.deadline is not None else None
        if left is not None and left < limit:
            return max(left, 0.0), True
        return limit, False

    def timeout_reason(self, limit: float, at_deadline: bool) -> dict[str, Any]:
        if at_deadline:
            return {
                "kind": "deadline",
                "reason": f"stopped at the study's deadline (timeout={self.timeout:g} s) after {limit:.0f} s; "
                "its worker was killed",
            }
        how = "trial_timeout" if self.fixed is not None else "the adaptive limit (see trial_timeout)"
        return {"reason": f"no result within {limit:.0f} s, {how}; the worker was killed"}


def _say_waiting(claims: list[FrozenTrial], said: set[int], study: optuna.Study) -> set[int]:
    """Say once, on stderr, which running trials this worker waits for, and until when."""
    import sys

    from autotune.search.storage import grace_period_of

    new = [t for t in claims if t.number not in said]
    if new:
        grace = grace_period_of(study)
        names = ", ".join(f"{t.number} (worker {t.user_attrs.get('worker', '?')})" for t in new)
        after = f"; one whose worker died is taken for dead {grace:g} s after its last heartbeat" if grace else ""
        print(
            f"autotune: waiting for trial {names} to finish: the rest of the budget is theirs{after}", file=sys.stderr
        )
    return said | {t.number for t in new}


def _tell_unmeasured(
    study: optuna.Study,
    trial: optuna.Trial,
    verdict: str,
    other: FrozenTrial | None,
    attrs: dict[str, Any],
    written: dict[str, Any],
    objectives: list[str],
    max_metric_drop: float,
    n_trials: int,
) -> None:
    """Tell a trial whose claim lost: answered from an earlier trial, or skipped."""
    if verdict == "repeat":
        result = {k: v for k, v in other.user_attrs.items() if k not in attrs and k != "baseline"}
        result.update(attrs, repeat_of=other.number, ran=False, baseline=False)
        _tell(study, trial, TrialResult.from_attrs(result), objectives, max_metric_drop, written)
        return
    reason = (
        f"not run: trial {other.number} is measuring the same configuration"
        if verdict == "duplicate"
        else f"not run: the budget of {n_trials} measured trials is taken by trials measured or running"
    )
    skipped = TrialResult("skipped", verdict, reason, {**attrs, "ran": False})
    _tell(study, trial, skipped, [], 0.0, written)


def _one_trial(
    study: optuna.Study,
    trial: optuna.Trial,
    runner: Runner,
    space: SearchSpace,
    objectives: list[str],
    max_metric_drop: float,
    extra_attrs: dict[str, Any],
    n_trials: int,
    on_trial: Callable[[dict[str, Any], int], None] | None,
    stop: threading.Event | None,
    limits: _Limits,
    strategy: Any = None,
) -> str:
    """Claim, measure (or answer) and tell one asked trial; return what became of it."""
    baseline_key = Config(dict(space.baseline)).key()
    queued_baseline = bool(trial.user_attrs.get("baseline"))
    config = _suggest(trial, space)  # for the queued baseline this records its enqueued params
    if queued_baseline:
        config = dict(space.baseline)
    key = Config(config).key()
    attrs = {"config": config, "baseline": key == baseline_key, **extra_attrs}
    for name, value in attrs.items():
        trial.set_user_attr(name, value)
    trial.set_user_attr("key", key)  # the claim: from here on other workers see it
    written = {**attrs, "key": key}
    verdict, other = _claim(study, trial.number, key, n_trials, baseline_key)
    # A retry queued by the heartbeat callback names the dead trial in its system attributes.
    retried = study.get_trials(deepcopy=False)[trial.number].system_attrs.get("failed_trial")
    if retried is not None:
        attrs["retry_of"] = retried
    attrs["key"] = key
    if verdict != "measure":
        _tell_unmeasured(study, trial, verdict, other, attrs, written, objectives, max_metric_drop, n_trials)
        return verdict
    trial.set_user_attr("measuring", True)
    finished = _finished(study)
    rule, fault = _oom_rule(config, finished), _fault_rule(config, finished)
    screened = None if strategy is None else strategy.refusal(config, [trial_record(t) for t in finished])
    if screened is not None:
        result = TrialResult("error", "screened", screened, {"ran": False, **attrs})
    elif rule is not None:
        result = TrialResult("oom", "oom-rule", rule, {"ran": False, **attrs})
    elif fault is not None:
        result = TrialResult("error", "fault-rule", fault, {"ran": False, **attrs})
    elif (late := limits.too_late(config, finished)) is not None:
        result = TrialResult("timeout", "deadline", late, {"ran": False, **attrs})
    else:
        limit, at_deadline = limits.for_config(config, finished)
        fidelity = trial_fidelity(trial.user_attrs.get("phase"), attrs["baseline"], objectives, finished, space)
        result = runner.run(config, timeout=limit, fidelity=fidelity)
        result.metrics.update(attrs, ran=result.metrics.get("ran", True))
        if stop is not None and stop.is_set() and result.status == "crash":
            raise KeyboardInterrupt  # its worker was killed to stop: no result to keep
        if result.status == "timeout" and result.metrics["ran"]:
            why = limits.timeout_reason(limit, at_deadline)
            result.fail("timeout", why.get("kind", result.kind), why["reason"])
    frozen = _tell(study, trial, result, objectives, max_metric_drop, written)
    if attrs["baseline"] and not result.ok:
        raise TrialError(
            result.kind or result.status,
            f"The baseline (the model as given) failed, so nothing can be compared with it: "
            f"{result.status}: {result.reason}. Fix the model, or raise trial_timeout if it is just slow.",
        )
    if on_trial is not None:
        on_trial(trial_record(frozen), _View(study.get_trials(deepcopy=False), baseline_key).n_measured)
    if screened is not None:
        return "screened"
    if result.kind == "deadline" and not result.metrics["ran"]:
        return "late"
    return "measured" if result.metrics["ran"] else "ruled"
