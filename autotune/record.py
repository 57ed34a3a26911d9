"""The record of a run, on the bottom floor so that every phase may read it: what a trial
stores (:func:`trial_record`, its result as one flat dict) and the :class:`Result` of a run
(what :func:`autotune.optimize` returns, and what :func:`autotune.report.data.load_result`
reads back from a finished run's files).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

__all__ = ["Result", "trial_record"]


def trial_record(trial: FrozenTrial) -> dict[str, Any]:
    """A trial's stored result as one flat dict: its user attributes (a
    :class:`~autotune.trial.spec.TrialResult` as ``to_attrs`` stores it), its number and state."""
    attrs = dict(trial.user_attrs)
    attrs["number"] = trial.number
    attrs["state"] = trial.state.name
    return attrs


@dataclasses.dataclass
class Result:
    """What :func:`optimize` found.

    Attributes:
        best_config: Every knob's chosen value (JSON-safe); feed it to :func:`apply` and
            :func:`dataloader`. An int8 winner's also holds ``rebuild`` (not a knob): the run's
            calibration draw and the layers it kept float, so ``apply`` rebuilds the model measured.
        best: The winner's metrics (``samples_per_s``, ``latency_ms_p95``, ``metric`` ...).
        baseline: The baseline's metrics, measured the same way.
        speedup: Best over baseline throughput in the confirmation rounds: the geometric mean of
            the rounds' ratios, which is also ``best["samples_per_s"] / baseline["samples_per_s"]``
            (1.0 when the baseline stands).
        speedup_min: Low end of the speedup's 95% confidence interval.
        speedup_max: High end of the speedup's 95% confidence interval.
        artifacts: Paths of the exported files that passed their parity check, by format.
        study: The Optuna study with every trial.
        out_dir: Where ``best_config.json``, ``trials.csv`` and ``study.db`` were written.
        stop_reason: ``"n_trials"`` (that many measured), ``"timeout"``, ``"budget"`` (the run's
            ``budget`` called the finish), ``"exhausted"`` (every configuration measured)
            or ``"converged"`` (refinement stopped improving; ``search["converged"]`` says how).
        pareto: With several objectives, the feasible Pareto front (also in ``pareto.json``).
        held_out: With a ``test_dataset``: the baseline's and the winner's metric on it.
        diagnosis: Why it won: the loader alone and the model alone timed for the baseline and
            the winner, whether each was data- or compute-bound, and a one-sentence ``summary``
            (or an ``error`` when that measurement failed).
        profile: Where the baseline's and the winner's time went (``torch.profiler``): by stage,
            by operator family and the top operators, with their traces' file names; ``None``
            with ``profile=False``.
        search: How the search went (:func:`autotune.search.phases.search_story`): its phases
            with the trials and seconds each took, when the winner was measured, and what
            screening left out with its measured ratio.
        verdict: ``"speedup"`` (confirmed: the interval excludes 1.0 on a quiet machine),
            ``"none"`` (no measurable speedup: the baseline stands), ``"slower"`` (the pick was
            measurably slower: with throughput the only objective the baseline stands; with others
            the pick may still win on them), ``"noisy"`` (the machine was
            too busy, or the rounds too spread, to claim one), ``"failed"`` (the confirmation
            rounds failed in the worker: ``claim`` gives the error; no speedup is claimed) or
            ``"unconfirmed"`` (interrupted, or measured elsewhere: the trials' own ratio).
        claimed: Whether ``speedup`` is a claim that stands (verdict ``speedup``, or the
            baseline is best).
        claim: One sentence saying what was measured and what is claimed.
        notes: Where the trials' own figures differ from the confirmed ones, what they said.
    """

    best_config: dict[str, Any]
    best: dict[str, Any]
    baseline: dict[str, Any]
    speedup: float
    speedup_min: float
    speedup_max: float
    artifacts: dict[str, Any]
    study: Any
    out_dir: Path
    stop_reason: str
    pareto: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    held_out: dict[str, Any] | None = None
    diagnosis: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    search: dict[str, Any] | None = None
    verdict: str = "speedup"
    claimed: bool = True
    claim: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"Result(speedup={self.speedup:.2f}x [{self.speedup_min:.2f}-{self.speedup_max:.2f}], "
            f"verdict={self.verdict!r}, best_config={self.best_config}, out_dir={str(self.out_dir)!r})"
        )
