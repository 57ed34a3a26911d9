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
from autotune.record import trial_record
from autotune.search.limits import (  # noqa: F401  (re-exported: tests and users import them from here)
    COMPILE_ALLOWANCE_S,
    FIRST_TRIAL_TIMEOUT_S,
    SCREEN_SHARE,
    TIMEOUT_FLOOR_S,
    _Limits,
    requeue_refused,
    trial_fidelity,
    trial_limit,
)
from autotune.search.record import (  # noqa: F401  (re-exported: tests and benchmarks import them from here)
    _fault_rule,
    _finished,
    _has_result,
    _oom_rule,
    _stopped,
    _tell,
    _tell_unmeasured,
    _View,
    n_measured,
)
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
from autotune.trial.phase import naming
from autotune.trial.runner import Runner
from autotune.trial.spec import TrialResult

__all__ = ["make_sampler", "open_study", "run_trials", "trial_fidelity", "trial_limit", "trial_record"]

# After this many suggestions in a row that were all measured (or held) before, the space is spent.
_MAX_REPEATS = 30
# This many trials in a row not started for the deadline end the search ("timeout"): the staged strategy moves
# on to cheaper levers after each; a sampler proposing only costly ones would otherwise never stop before it.
_MAX_LATE = 30

# A worker waiting for others (the budget spoken for) looks at the study again this often.
_POLL_S = 0.5
# How long a claim waits for younger claims on the same key or budget slot to withdraw.
_CLAIM_WAIT_S = 5.0


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


def _converged(study: optuna.Study, objectives: Sequence[str], strategy: Any) -> bool:
    """Whether the staged search's refinement stopped paying (see
    :func:`autotune.search.phases.converged`); the reason is kept on the study."""
    from autotune.search.phases import converged

    key, direction = OBJECTIVES[objectives[0]][:2]
    why = converged([trial_record(t) for t in _finished(study)], key, direction == "maximize")
    if why is not None:
        study.set_user_attr("converged", why)
    return why is not None


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
        Why the loop stopped: ``"n_trials"`` (that many measured), ``"timeout"``, ``"exhausted"`` or, with the staged
        strategy, ``"converged"`` (refinement stopped improving: see
        :func:`autotune.search.phases.converged`; the reason is the study's ``converged`` attribute).

    Raises:
        TrialError: the baseline failed (here or in another worker).
    """
    objectives = check_objectives(objectives)
    baseline_key = Config(dict(space.baseline)).key()
    study.set_user_attr("n_trials", n_trials)  # for `autotune status`: the budget last asked for
    deadline = None if timeout is None else time.monotonic() + timeout
    limits = _Limits(runner, trial_timeout, deadline, timeout, reserve, study)
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
            return "n_trials"
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

            if not requeue_refused(study, limits):  # a lever refused for time, now affordable, goes first
                queue_next(study, strategy, n_trials, limits, room=n_trials - view.n_measured - len(view.claims))
        outcome = _ask_and_run(
            study,
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
        if outcome is None:
            continue
        late = late + 1 if outcome == "late" else 0
        if late >= _MAX_LATE:  # nothing proposed fits in what is left: the deadline ended it
            return "timeout"
        # A refusal of a value left out after screening costs no budget: many in a row, the space is spent.
        repeats = repeats + 1 if outcome in ("repeat", "duplicate", "screened") else 0


def _ask_and_run(study: optuna.Study, *args: Any) -> str | None:
    """Ask for the next trial, then claim, measure (or answer) and tell it under its heartbeat
    (:func:`_one_trial`, given ``args``); ``None`` when another worker took it for dead meanwhile."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        trial = study.ask()
    with heartbeat(study, trial):
        try:
            return _one_trial(study, trial, *args)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Declared dead while alive (the database out of reach longer than the grace
            # period): its retry measures the configuration again.
            warnings.warn(
                f"Trial {trial.number} was marked failed by another worker (no heartbeat for the grace "
                "period); its result is dropped and its retry will measure it again.",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        except BaseException:
            # Ctrl-C or an error between ask and tell: no trial is left RUNNING in the storage.
            if study.trials[trial.number].state == TrialState.RUNNING:
                trial.set_user_attr("status", "interrupted")
                study.tell(trial, state=TrialState.FAIL)
            raise


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
        fidelity = trial_fidelity(trial.user_attrs.get("phase"), attrs["baseline"], objectives, finished, space, config)
        with naming(runner, trial.number, config):  # the display names it while it runs
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
