"""Optuna wiring: sampler, storage, the baseline enqueued first, the guard as a constraint,
duplicates answered from earlier measurements, out-of-memory rules, budget and resume.

Every trial's result is stored in the study (SQLite by default) the moment it is known, as
user attributes: ``config``, ``status``, ``kind``, ``reason`` and the metrics. Nothing else
keeps state, so an interrupted study resumes from its storage alone.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from ._select import OBJECTIVES, check_objectives
from .config import Config
from .errors import ConfigError, TrialError
from .knobs import REGISTRY
from .runner import Runner
from .space import SearchSpace

__all__ = ["open_study", "run_trials", "trial_record"]

# Knobs whose values change how much memory a batch needs.
_MEMORY_KNOBS = ("amp_dtype", "compile_mode", "channels_last")
# After this many suggestions in a row that were all measured before, the space is spent.
_MAX_REPEATS = 30


def open_study(
    storage: str,
    study_name: str,
    objectives: Sequence[str],
    seed: int,
    resume: bool,
    sampler: optuna.samplers.BaseSampler | None = None,
) -> optuna.Study:
    """Create the study, or load it with ``resume=True``.

    Raises:
        ConfigError: the study exists and ``resume`` is false, or the storage URL is unusable.
    """
    objectives = check_objectives(objectives)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        existing = {s.study_name: s.n_trials for s in optuna.get_all_study_summaries(storage)}
    except Exception as exc:
        raise ConfigError(f"Cannot open storage {storage!r}: {type(exc).__name__}: {exc}") from None
    if study_name in existing and not resume and existing[study_name] > 0:
        raise ConfigError(
            f"Study {study_name!r} already exists in {storage} with {existing[study_name]} trials. "
            "Pass resume=True (CLI: --resume) to continue it, or choose another study name or output directory."
        )
    if sampler is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=8)
    return optuna.create_study(
        storage=storage,
        study_name=study_name,
        sampler=sampler,
        directions=[OBJECTIVES[o][1] for o in objectives],
        load_if_exists=True,
    )


def trial_record(trial: FrozenTrial) -> dict[str, Any]:
    """A trial's stored result as one flat dict."""
    attrs = dict(trial.user_attrs)
    attrs["number"] = trial.number
    attrs["state"] = trial.state.name
    return attrs


def _finished(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and "status" in t.user_attrs]


def _suggest(trial: optuna.Trial, space: SearchSpace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name, knob in REGISTRY.items():
        values = space.values[name]
        if not knob.applies(config):
            config[name] = space.baseline[name]
        elif len(values) == 1:
            config[name] = values[0]
        else:
            config[name] = trial.suggest_categorical(name, values)
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


def _tell(
    study: optuna.Study, trial: optuna.Trial, result: dict[str, Any], objectives: list[str], max_drop: float
) -> FrozenTrial:
    if result["status"] == "ok" and result.get("metric_drop", 0.0) > max_drop + 1e-12:
        result["status"], result["kind"] = "infeasible", "guard"
        result["reason"] = f"metric dropped by {result['metric_drop']:.4g}, more than max_metric_drop={max_drop:g}"
    for key, value in result.items():
        trial.set_user_attr(key, value)
    keys = [OBJECTIVES[o][0] for o in objectives]
    if result["status"] in ("ok", "infeasible") and all(k in result for k in keys):
        trial.set_constraint(
            "metric_drop", result.get("metric_drop", 1.0) - max_drop if result["status"] == "ok" else 1.0
        )
        return study.tell(trial, [float(result[k]) for k in keys])
    return study.tell(trial, state=TrialState.FAIL)


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
) -> str:
    """Measure trials until ``n_trials`` have been measured in the study (resume counts the
    earlier ones), ``timeout`` seconds pass, or the space is spent.

    Returns:
        Why the loop stopped: ``"budget"``, ``"timeout"`` or ``"exhausted"``.
    """
    objectives = check_objectives(objectives)
    finished = _finished(study)
    seen = {t.user_attrs["key"]: t for t in finished if "key" in t.user_attrs}
    if not any(t.user_attrs.get("baseline") for t in finished):
        study.enqueue_trial({n: space.baseline[n] for n in space.searched if REGISTRY[n].applies(space.baseline)})
    n_measured = sum(1 for t in finished if not t.user_attrs.get("repeat_of") and t.user_attrs.get("ran", False))
    started = time.monotonic()
    repeats = 0
    while n_measured < n_trials:
        if timeout is not None and time.monotonic() - started >= timeout:
            return "timeout"
        if repeats >= _MAX_REPEATS:
            return "exhausted"
        trial = study.ask()
        try:
            n_measured, repeats = _one_trial(
                study,
                trial,
                runner,
                space,
                objectives,
                max_metric_drop,
                extra_attrs,
                seen,
                n_measured,
                repeats,
                on_trial,
            )
        except BaseException:
            # Ctrl-C or an error between ask and tell: no trial is left RUNNING in the storage.
            if study.trials[trial.number].state == TrialState.RUNNING:
                trial.set_user_attr("status", "interrupted")
                study.tell(trial, state=TrialState.FAIL)
            raise
    return "budget"


def _one_trial(
    study: optuna.Study,
    trial: optuna.Trial,
    runner: Runner,
    space: SearchSpace,
    objectives: list[str],
    max_metric_drop: float,
    extra_attrs: dict[str, Any],
    seen: dict[str, FrozenTrial],
    n_measured: int,
    repeats: int,
    on_trial: Callable[[dict[str, Any], int], None] | None,
) -> tuple[int, int]:
    """Fill and tell one asked trial; return the updated (measured, repeats-in-a-row) counts."""
    is_baseline = not any(t.user_attrs.get("baseline") for t in _finished(study))
    config = dict(space.baseline) if is_baseline else _suggest(trial, space)
    if is_baseline:
        _suggest(trial, space)  # records the enqueued baseline params
    key = Config(config).key()
    attrs = {"config": config, "key": key, "baseline": is_baseline, **extra_attrs}
    if key in seen:
        earlier = seen[key]
        result = {k: v for k, v in earlier.user_attrs.items() if k not in attrs and k != "baseline"}
        result.update(attrs, repeat_of=earlier.number, ran=False)
        _tell(study, trial, result, objectives, max_metric_drop)
        return n_measured, repeats + 1
    rule = _oom_rule(config, _finished(study))
    if rule is not None:
        result = {"status": "oom", "kind": "oom-rule", "reason": rule, "ran": False, **attrs}
    else:
        result = {**runner.run(config), **attrs, "ran": True}
        n_measured += 1
    repeats = 0
    frozen = _tell(study, trial, result, objectives, max_metric_drop)
    seen[key] = frozen
    if is_baseline and result["status"] != "ok":
        raise TrialError(
            result.get("kind") or result["status"],
            f"The baseline (the model as given) failed, so nothing can be compared with it: "
            f"{result['status']}: {result.get('reason')}. Fix the model, or raise trial_timeout if it is just slow.",
        )
    if on_trial is not None:
        on_trial(trial_record(frozen), n_measured)
    return n_measured, repeats
