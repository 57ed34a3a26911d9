"""The end of a search: the winner re-measured against the baseline, and the result files."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import InputError

__all__ = ["Result", "baseline_and_best", "verify", "write_best", "write_pareto"]


@dataclasses.dataclass
class Result:
    """What :func:`optimize` found.

    Attributes:
        best_config: Every knob's chosen value (JSON-safe); feed it to :func:`apply` and
            :func:`dataloader`.
        best: The winner's metrics (``samples_per_s``, ``latency_ms_p95``, ``metric`` ...).
        baseline: The baseline's metrics, measured the same way.
        speedup: Median ratio of best to baseline throughput over interleaved re-measurements.
        speedup_min: Smallest pair ratio.
        speedup_max: Largest pair ratio.
        artifacts: Paths of the exported files that passed their parity check, by format.
        study: The Optuna study with every trial.
        out_dir: Where ``best_config.json``, ``trials.csv`` and ``study.db`` were written.
        stop_reason: ``"budget"``, ``"timeout"`` or ``"exhausted"`` (every configuration measured).
        pareto: With several objectives, the feasible Pareto front (also in ``pareto.json``).
        held_out: With a ``test_dataset``: the baseline's and the winner's metric on it.
        diagnosis: Why it won: the loader alone and the model alone timed for the baseline and
            the winner, whether each was data- or compute-bound, and a one-sentence ``summary``
            (or an ``error`` when that measurement failed).
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

    def __repr__(self) -> str:
        return (
            f"Result(speedup={self.speedup:.2f}x [{self.speedup_min:.2f}-{self.speedup_max:.2f}], "
            f"best_config={self.best_config}, out_dir={str(self.out_dir)!r})"
        )


def baseline_and_best(study: Any, objectives: Sequence[str], select: Any, required: bool = True) -> Any:
    from ._select import choose
    from .study import trial_record

    records = [trial_record(t) for t in study.get_trials(deepcopy=False)]
    baseline = next((r for r in records if r.get("baseline") and r.get("status") == "ok"), None)
    if baseline is None:
        if required:
            raise InputError("The baseline was never measured successfully; see trials.csv for why.")
        return None
    return baseline, choose(records, objectives, select) or baseline


def verify(
    runner: Any, baseline: dict[str, Any], finalists: list[dict[str, Any]], n_rounds: int, speed_only: bool
) -> tuple[dict[str, Any], list[float] | None, list[dict[str, Any]]]:
    """Re-measure the finalists interleaved with the baseline; return (winner, its ratios, table).

    When speed is the only objective and no finalist beats the baseline on re-measurement, the
    baseline wins; with other objectives (size, say) a slower winner can still be the right one.
    """
    from .errors import TrialError

    try:
        # Each of the (finalists + 1) x rounds measurements is at most one trial's work.
        budget = (len(finalists) + 1) * n_rounds
        rounds = runner.call("verify", baseline["config"], [f["config"] for f in finalists], n_rounds, n_trials=budget)[
            "rounds"
        ]
    except TrialError as exc:  # the study stands; its best trial is reported unverified
        return finalists[0], None, [{"error": str(exc)}]
    ratios = [[r[i + 1] / r[0] for r in rounds] for i in range(len(finalists))]
    table = [
        {"trial": f["number"], "median": statistics.median(rs), "min": min(rs), "max": max(rs)}
        for f, rs in zip(finalists, ratios, strict=True)
    ]
    pick = max(range(len(finalists)), key=lambda i: statistics.median(ratios[i]))
    if speed_only and statistics.median(ratios[pick]) < 1.0:
        return baseline, None, table  # re-measured, nothing beats the model as given
    return finalists[pick], ratios[pick], table


def write_pareto(out: Path, records: list[dict[str, Any]], objectives: Sequence[str]) -> list[dict[str, Any]]:
    """Write ``pareto.json``: the feasible Pareto front, best first on the first objective."""
    from . import report
    from ._select import pareto_front

    front = [
        {"trial": r["number"], "config": r["config"], **{k: r.get(k) for k in (*report.METRIC_KEYS, "batch_size")}}
        for r in pareto_front(records, objectives)
    ]
    report.write_json(out / "pareto.json", {"objectives": list(objectives), "front": front})
    return front


def write_best(
    out: Path,
    summary: dict[str, Any],
    baseline: dict[str, Any],
    best: dict[str, Any],
    *,
    ratios: list[float] | None,
    stop_reason: str,
    study: Any = None,
) -> Result:
    """Write ``best_config.json`` and return the :class:`Result`.

    ``ratios`` are the interleaved pair ratios; ``None`` means best is the baseline (ratio 1)
    or, when interrupted, that the ratio of the two trials' own measurements stands unverified.
    """
    from . import report

    if ratios is not None:
        method = "interleaved"
    elif best["key"] == baseline["key"]:
        ratios, method = [1.0], "baseline is best"
    else:
        ratios, method = [best["samples_per_s"] / baseline["samples_per_s"]], "trial ratio, not verified"
    keys = (*report.METRIC_KEYS, "batch_size", *(report.TRAIN_KEYS if summary.get("mode") == "train" else ()))
    result = Result(
        best_config=dict(best["config"]),
        best={k: best.get(k) for k in keys},
        baseline={k: baseline.get(k) for k in keys},
        speedup=statistics.median(ratios),
        speedup_min=min(ratios),
        speedup_max=max(ratios),
        artifacts={k: str(out / v["path"]) for k, v in summary.get("artifacts", {}).items() if v.get("status") == "ok"},
        study=study,
        out_dir=out,
        stop_reason=stop_reason,
    )
    speedup = {"median": result.speedup, "min": result.speedup_min, "max": result.speedup_max}
    speedup.update(n_pairs=len(ratios) if method == "interleaved" else 0, method=method)
    report.write_json(
        out / "best_config.json",
        {
            "schema_version": report.SCHEMA_VERSION,
            "created": report.now_iso(),
            **summary,
            "config": result.best_config,
            "baseline_config": baseline["config"],
            "best": result.best,
            "baseline": result.baseline,
            "speedup": speedup,
            "trial": best["number"],
            "n_trials": len(study.trials) if study is not None else None,
            "stop_reason": stop_reason,
            "artifacts": summary.get("artifacts", {}),
        },
    )
    result.held_out = summary.get("held_out")
    result.diagnosis = summary.get("diagnosis")
    return result
