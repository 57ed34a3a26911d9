"""The end of a search: the winner re-measured against the baseline, and the result files."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.errors import InputError

__all__ = ["Result", "baseline_and_best", "claim_speedup", "confirm", "select", "write_best", "write_pareto"]


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
        stop_reason: ``"budget"``, ``"timeout"``, ``"exhausted"`` (every configuration measured)
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


def baseline_and_best(study: Any, objectives: Sequence[str], select: Any, required: bool = True) -> Any:
    from autotune.search.record import trial_record
    from autotune.search.select import choose

    records = [trial_record(t) for t in study.get_trials(deepcopy=False)]
    baseline = next((r for r in records if r.get("baseline") and r.get("status") == "ok"), None)
    if baseline is None:
        if required:
            raise InputError("The baseline was never measured successfully; see trials.csv for why.")
        return None
    return baseline, choose(records, objectives, select) or baseline


def _figures(rounds: list[list[dict[str, Any]]], i: int) -> dict[str, Any]:
    """Configuration ``i``'s figures over rounds: throughput as the geometric mean (so that the
    ratio of two configurations' figures is the claimed speedup), the rest as medians."""
    from autotune.search.claims import geomean

    col = [r[i] for r in rounds]
    out: dict[str, Any] = {"samples_per_s": geomean([c["samples_per_s"] for c in col])}
    for key in ("latency_ms_p50", "latency_ms_p95", "loader_samples_per_s", "model_samples_per_s"):
        if all(key in c for c in col):
            out[key] = statistics.median(c[key] for c in col)
    out["others_cpu"] = statistics.fmean(c.get("others_cpu", 0.0) for c in col)
    return out


def _rounds(
    runner: Any, configs: list[dict[str, Any]], n_min: int, n_max: int, **kw: Any
) -> list[list[dict[str, Any]]]:
    return _rounds_reply(runner, configs, n_min, n_max, **kw)["rounds"]


def _rounds_reply(runner: Any, configs: list[dict[str, Any]], n_min: int, n_max: int, **kw: Any) -> dict[str, Any]:
    # Each round is at most one trial's work per configuration.
    return runner.call("rounds", configs, n_min, n_max, kw.get("target"), kw.get("max_s"), kw.get("diagnose", False),
                       kw.get("drawn", 0), n_trials=len(configs) * n_max)  # fmt: skip


def select(
    runner: Any, baseline: dict[str, Any], finalists: list[dict[str, Any]], n_rounds: int, max_s: float | None = None
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Pick one finalist on interleaved selection rounds against the baseline (``n_rounds``, or
    as many as fit in ``max_s`` seconds, two at least).

    Returns:
        (the pick, or ``None`` when no finalist beat the baseline in these rounds, the finalists'
        table). With one finalist nothing needs choosing: no rounds are run.
    """
    from autotune.search.claims import interval

    if len(finalists) == 1:
        return finalists[0], [{"trial": finalists[0]["number"], "selection": "the only finalist"}]
    n_min = n_rounds if max_s is None else min(2, n_rounds)
    rounds = _rounds(runner, [baseline["config"], *(f["config"] for f in finalists)], n_min, n_rounds, max_s=max_s)
    table = []
    for i, f in enumerate(finalists, start=1):
        ratios = [r[i]["samples_per_s"] / r[0]["samples_per_s"] for r in rounds]
        mid, lo, hi = interval(ratios)
        table.append({"trial": f["number"], "ratio": mid, "low": lo, "high": hi, "median": statistics.median(ratios),
                      "min": min(ratios), "max": max(ratios), "n_rounds": len(ratios)})  # fmt: skip
    pick = max(range(len(finalists)), key=lambda k: table[k]["ratio"])
    table[pick]["picked"] = True
    return (finalists[pick] if table[pick]["ratio"] > 1.0 else None), table


def confirm(
    runner: Any,
    baseline: dict[str, Any],
    pick: dict[str, Any],
    settings: Any,
    *,
    n_min: int = 5,
    n_max: int = 15,
    target: float | None = None,
    max_s: float = 90.0,
    diagnose: bool = True,
) -> dict[str, Any]:
    """Fresh interleaved rounds of the baseline and the pick alone: the claim.

    Rounds continue until the ratio's 95% interval is within +-``target`` or ``n_max`` rounds
    (or ``max_s`` seconds) are spent. With ``diagnose``, the loader alone and the model alone are
    timed in the same rounds.

    Returns:
        ``{"claim": judge(...), "baseline": figures, "best": figures, "rounds": n}``, see
        :func:`autotune.search.claims.judge`.
    """
    from autotune.search.claims import CONFIRM_DRAWS, CONFIRM_PROCESSES, TARGET_HALF_WIDTH, geomean, judge, shortfall

    target = TARGET_HALF_WIDTH if target is None else target
    groups, pids, why = _process_rounds(runner, [baseline["config"], pick["config"]], n_min, n_max, CONFIRM_PROCESSES,
                                        target=target, max_s=max_s, diagnose=diagnose, drawn=CONFIRM_DRAWS)  # fmt: skip
    rounds = [r for g in groups for r in g]
    ratios = [r[1]["samples_per_s"] / r[0]["samples_per_s"] for r in rounds]
    processes = [geomean([r[1]["samples_per_s"] / r[0]["samples_per_s"] for r in g]) for g in groups]
    base, best = _figures(rounds, 0), _figures(rounds, 1)
    others = statistics.fmean([base["others_cpu"], best["others_cpu"]])
    short = shortfall(ratios, len(groups), why, n_max, target, max_s)
    claim = judge(ratios, others, settings.max_others_cpu, processes=processes if len(groups) > 1 else (),
                  shortfall=short)  # fmt: skip
    claim["n_processes"] = len(groups)
    # A shape compiled, or run eager past dynamo's limit, inside the rounds' windows: said, not hidden.
    claim["recompiles"] = sum(r[i].get("recompiles", 0) for r in rounds for i in (0, 1))
    claim["compile_fallbacks"] = max((r[1].get("compile_fallbacks", 0) for r in rounds), default=0)
    if claim["compile_fallbacks"]:
        claim["sentence"] += (
            "; the pick ran batches of some shapes eager (torch.compile reached dynamo's recompile limit), "
            "as it will in use"
        )
    if claim["recompiles"]:
        claim["sentence"] += f"; {claim['recompiles']} compile(s) fell inside the rounds' timed windows"
    return {"claim": claim, "baseline": base, "best": best, "worker_pids": pids}


def _process_rounds(
    runner: Any, configs: list[dict[str, Any]], n_min: int, n_max: int, n_processes: int, **kw: Any
) -> tuple[list[list[list[dict[str, Any]]]], list[int | None], str | None]:
    """Interleaved rounds split over up to ``n_processes`` worker processes, a fresh one each
    (where the runner can start one): each process's rounds (at least two each), its pid, and
    why fewer processes ran than ``n_processes`` (``None`` when none is missing).

    The first process is fresh too, not the worker that ran the trials, which carries what
    every trial left in it (in one real-text run it gave the pick 5.45x, a fresh worker 6.51x
    and the user's own fresh processes 6.58x): a user's process is a fresh one. The first
    process gets its share of ``max_s``; a later one starts only while at least half a share is
    left, so a run's timeout still bounds the claim."""
    import math
    import time

    from autotune.errors import TrialError

    max_s = kw.pop("max_s", None)
    why = None if runner.restarts else "isolation='inprocess' starts no worker process"
    n_processes = n_processes if runner.restarts else 1
    # Confirmation rounds draw from a range of their own: a fresh process counts rounds from
    # zero, and would otherwise re-read the batches the selection rounds drew.
    started, groups, pids, drawn = time.monotonic(), [], [], kw.pop("drawn", 0)
    for k in range(n_processes):
        if k:
            left = None if max_s is None else max_s - (time.monotonic() - started)
            if left is not None and left / (n_processes - k) < 0.5 * max_s / n_processes:
                # Too little time left for another process's rounds (its start and builds too).
                why = f"{max(left, 0.0):.3g} s of the confirmation's {max_s:.3g} s were left, too little for another"
                break
        try:
            if not runner.restart() and k:
                why = "a fresh worker process could not be started"
                break
            # The share is what is left after the new process started: its start counts too.
            left = None if max_s is None else max_s - (time.monotonic() - started)
            share = None if left is None else max(left, 0.0) / (n_processes - k)
            n_lo = max(2, math.ceil(n_min / n_processes))
            n_hi = max(n_lo, math.ceil(n_max / n_processes))
            # Each process draws batches after the earlier ones': no round re-reads another's.
            reply = _rounds_reply(runner, configs, n_lo, n_hi, max_s=share, drawn=drawn, **kw)
        except TrialError as exc:
            if not k or exc.kind != "deadline":
                raise
            # The run's deadline cut a later process short: the earlier one's rounds stand.
            why = f"the run's deadline cut the next process short ({exc})"
            break
        groups.append(reply["rounds"])
        pids.append(reply.get("pid"))
        drawn = reply.get("drawn", drawn)
    return groups, pids, why


def claim_speedup(
    runner: Any,
    baseline: dict[str, Any],
    finalists: list[dict[str, Any]],
    n_rounds: int,
    speed_only: bool,
    settings: Any,
    diagnose: bool = True,
    budget_s: float | None = None,
    need_s: float = 0.0,
) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    """Select among the finalists, then confirm the pick on fresh rounds; with ``budget_s``
    (a study with a timeout), each step stops after about half of it once its least rounds ran.
    A ``budget_s`` under ``need_s`` (the least confirmation's predicted cost) runs nothing: the
    claim is then "unconfirmed: deadline", as it is when the deadline cuts the rounds off.

    Returns:
        (the winner's record, the confirmation (see :func:`confirm`) or ``None`` when the
        baseline stands, the finalists' table). When speed is the only objective, the baseline
        stands if no finalist beats it in selection or the confirmation finds no measurable
        speedup, finds the pick slower (``slower``), or ran beside busy processes (``noisy``); with
        other objectives (size, say) a slower winner can still be the right one (verdict ``slower``).
        A measurement that fails in the worker leaves the search's best trial, and the table
        holds ``{"error": message, "failed": True}``: the claim is that failure (verdict ``failed``).
    """
    from autotune.errors import TrialError

    if budget_s is not None and budget_s < max(need_s, 2.0):  # too little left to confirm anything
        left = f"{budget_s:.0f} s were left before the run's deadline"
        return finalists[0], None, [{"error": f"{left}, and confirming the pick needs about {need_s:.0f} s",
                                     "deadline": True}]  # fmt: skip
    try:
        # Selection and confirmation share the budget; with one finalist nothing is selected.
        half = None if budget_s is None else budget_s / (1 if len(finalists) == 1 else 2)
        pick, table = select(runner, baseline, finalists, n_rounds, max_s=half)
        if pick is None:
            if speed_only:
                return baseline, None, table
            pick = finalists[0]
        n_min = n_rounds if half is None else min(3, n_rounds)
        confirmed = confirm(runner, baseline, pick, settings, n_min=n_min, n_max=3 * n_rounds, diagnose=diagnose,
                            max_s=90.0 if half is None else half)  # fmt: skip
    except TrialError as exc:  # the study stands; the claim is this failure, with its message
        if exc.kind == "deadline":  # cut off by the run's deadline: unconfirmed, not failed
            return finalists[0], None, [{"error": str(exc), "deadline": True}]
        return finalists[0], None, [{"error": str(exc), "failed": True}]
    if speed_only and confirmed["claim"]["verdict"] in ("none", "noisy", "slower"):
        # Nothing measurable, measurably slower, or measured beside busy processes: a pick made
        # under load (one thread, say) can be slower on a quiet machine, so the model as given stands.
        confirmed["kept_baseline"] = pick["number"]
        return baseline, confirmed, table
    return pick, confirmed, table


def write_pareto(out: Path, records: list[dict[str, Any]], objectives: Sequence[str]) -> list[dict[str, Any]]:
    """Write ``pareto.json``: the feasible Pareto front, best first on the first objective."""
    import autotune.report.summary as report
    from autotune.search.select import pareto_front

    front = [
        {"trial": r["number"], "config": r["config"], **{k: r.get(k) for k in (*report.METRIC_KEYS, "batch_size")}}
        for r in pareto_front(records, objectives)
    ]
    report.write_json(out / "pareto.json", {"objectives": list(objectives), "front": front})
    return front


# How the speedup entry names a confirmation that kept the baseline, by verdict.
_KEPT_METHOD = {"noisy": "not claimed, baseline kept", "slower": "pick slower, baseline kept"}


def _claim_fields(
    baseline: dict[str, Any],
    best: dict[str, Any],
    confirmed: dict[str, Any] | None,
    interrupted: bool,
    why_unconfirmed: str | None = None,
    failure: str | None = None,
) -> dict[str, Any]:
    """The ``speedup`` entry of best_config.json: one measurement behind every figure shown; a
    ``failure`` of the confirmation rounds in the worker is the verdict, with its message."""
    if confirmed is not None:
        claim = dict(confirmed["claim"])
        if best["key"] == baseline["key"]:  # confirmation found nothing to claim: the baseline stands
            kept = claim["verdict"] in ("noisy", "slower")
            sentence = claim["sentence"] + (f"; the baseline is kept (trial {confirmed.get('kept_baseline')} was the "
                                            "pick, see speedup.rejected)" if kept else "")  # fmt: skip
            method = _KEPT_METHOD.get(claim["verdict"], "no measurable speedup")
            return {**claim, "speedup": 1.0, "low": 1.0, "high": 1.0, "sentence": sentence, "method": method,
                    "rejected_trial": confirmed.get("kept_baseline"), "rejected": confirmed["claim"]}  # fmt: skip
        return {**claim, "method": "confirmation rounds"}
    if best["key"] == baseline["key"]:
        return {"verdict": "none", "speedup": 1.0, "low": 1.0, "high": 1.0, "n_rounds": 0, "method": "baseline is best",
                "sentence": "no configuration beat the baseline"}  # fmt: skip
    ratio = best["samples_per_s"] / baseline["samples_per_s"]
    if failure is not None and not interrupted and why_unconfirmed is None:
        return {"verdict": "failed", "speedup": 1.0, "low": None, "high": None, "n_rounds": 0,
                "method": "confirmation rounds failed", "error": failure, "trial_ratio": ratio,
                "sentence": f"no speedup claimed: the confirmation rounds failed in the worker: {failure}"}  # fmt: skip
    why = why_unconfirmed or ("the run was interrupted" if interrupted else "its confirmation rounds failed")
    # A deadline is no fault of the pick: "unconfirmed: deadline", the best measured kept.
    said = f"unconfirmed: {why}" if why.startswith("deadline") else f"not confirmed: {why}"
    return {"verdict": "unconfirmed", "speedup": ratio, "low": None, "high": None, "n_rounds": 0,
            "method": "trial ratio, not confirmed", "why": "deadline" if why.startswith("deadline") else why,
            "sentence": f"{ratio:.2f}x from the two trials' own measurements, {said}"}  # fmt: skip


def _shown(record: dict[str, Any], figures: dict[str, Any] | None, keys: Sequence[str]) -> dict[str, Any]:
    """A record's metrics with the confirmation rounds' figures in place of its trial's."""
    out = {k: record.get(k) for k in keys}
    if figures:
        out.update({k: v for k, v in figures.items() if k in keys})
    return out


def figures_note(trial: dict[str, Any], shown: dict[str, Any], label: str) -> str | None:
    """A sentence when a trial's own throughput differs from the confirmed one by more than 10%."""
    a, b = trial.get("samples_per_s"), shown.get("samples_per_s")
    if not a or not b or abs(a / b - 1.0) <= 0.10:
        return None
    return (
        f"the {label}'s trial measured {a:,.0f} samples/s, the confirmation rounds {b:,.0f} ({b / a - 1:+.0%}); "
        "the confirmed figure is the one shown and claimed"
    )


def _int8_record(best: dict[str, Any]) -> dict[str, Any] | None:
    """The int8 fallback of the winner: layers kept float (with each one's int8 output error), out of how
    many, and the weights' bytes before int8; ``None`` for a float winner."""
    if "int8_kept" not in best and "float_bytes" not in best:
        return None
    errors, scores = best.get("int8_kept_error"), best.get("int8_kept_score")
    config = best.get("config") or {}
    runtime = config.get("runtime", "torch")
    method = config.get("ort_precision") if runtime == "onnxruntime" else config.get("quantization")
    return {
        "method": method,
        "runtime": "onnxruntime" if runtime == "onnxruntime" else "torch",
        # Dynamic int8 scales weights per tensor unless asked; the other methods per channel.
        "per_channel": bool(config.get("int8_per_channel")) or method != "int8_dynamic",
        "kept_float": best.get("int8_kept", []),
        # Each kept layer's relative output error with it alone in int8, and the guard's
        # criterion with it alone in int8 for the layers the exact pass refined.
        "kept_error": json.loads(errors) if isinstance(errors, str) else errors,
        "kept_score": json.loads(scores) if isinstance(scores, str) else scores,
        "n_layers": best.get("int8_layers"),
        "float_bytes": best.get("float_bytes"),
        "bytes": best.get("size_bytes"),
    }


def _counts(study: Any) -> dict[str, Any]:
    """``n_measured`` and ``n_repeats`` of ``study``'s trials, as the reports count them."""
    if study is None:
        return {}
    from autotune.report.summary import trial_counts
    from autotune.search.record import trial_record

    counts = trial_counts([trial_record(t) for t in study.get_trials(deepcopy=False)])
    return {"n_measured": counts["n_measured"], "n_repeats": counts["n_repeats"]}


def _rebuild_record(summary: dict[str, Any], best: dict[str, Any]) -> dict[str, Any] | None:
    """For an int8 winner, what :func:`autotune.apply` needs to rebuild the very model measured:
    the run's calibration draw and the layers it kept float (``None`` for any other winner)."""
    config = best.get("config") or {}
    ort = config.get("runtime") == "onnxruntime" and str(config.get("ort_precision", "")).startswith("int8")
    if not summary.get("rebuild") or (config.get("quantization", "none") == "none" and not ort):
        return None
    kept = best.get("int8_kept") if best.get("int8_layers") else None
    kept = json.loads(kept) if isinstance(kept, str) else kept
    return {**summary["rebuild"], "int8_kept_float": list(kept) if isinstance(kept, (list, tuple)) else None}


def write_best(
    out: Path,
    summary: dict[str, Any],
    baseline: dict[str, Any],
    best: dict[str, Any],
    *,
    confirmed: dict[str, Any] | None,
    stop_reason: str,
    study: Any = None,
    interrupted: bool = False,
    why_unconfirmed: str | None = None,
) -> Result:
    """Write ``best_config.json`` and return the :class:`Result`.

    ``confirmed`` is :func:`confirm`'s result (``None``: best is the baseline unmeasured again,
    or the run was interrupted, and the ratio of the two trials' own measurements stands,
    marked unconfirmed). The throughput and latency shown for best and baseline are then the
    confirmation rounds' figures, whose ratio is the speedup; the trials' own are kept apart.
    """
    import autotune.report.summary as report

    finalists = [f for f in summary.get("finalists") or [] if isinstance(f, dict)]
    failed = [f["error"] for f in finalists if f.get("failed")]
    late = [f["error"] for f in finalists if f.get("deadline")]
    if late and why_unconfirmed is None:
        why_unconfirmed = f"deadline ({late[0]})"
    claim = _claim_fields(baseline, best, confirmed, interrupted, why_unconfirmed, failed[0] if failed else None)
    if (best.get("config") or {}).get("cache_decoded") and summary.get("mode") != "train":
        # Measured over passes that read the same samples again: true only where use does too.
        claim["assumes"] = "the same samples are read again (repeated_passes): a cache of decoded samples pays there"
        claim["sentence"] += "; assuming the same samples are read again, as the decoded-sample cache needs"
    keys = (*report.METRIC_KEYS, "batch_size", *(report.TRAIN_KEYS if summary.get("mode") == "train" else ()))
    figures = confirmed or {}
    same = best["key"] == baseline["key"]
    shown_base = _shown(baseline, figures.get("baseline"), keys)
    shown_best = shown_base if same else _shown(best, figures.get("best"), keys)
    if confirmed is not None:
        for shown in (shown_base, shown_best):  # one figure per rounds: no window spread to show
            shown.update(samples_per_s_min=None, samples_per_s_max=None, cov=None)
    notes = [n for n in (figures_note(baseline, shown_base, "baseline"), None if same else
             figures_note(best, shown_best, "winner")) if n]  # fmt: skip
    claimed = claim["verdict"] == "speedup" or (same and claim["method"] == "baseline is best")
    rebuild = _rebuild_record(summary, best)
    result = Result(
        best_config={**best["config"], "rebuild": rebuild} if rebuild else dict(best["config"]),
        best=shown_best,
        baseline=shown_base,
        speedup=claim["speedup"],
        speedup_min=claim["low"] if claim.get("low") is not None else claim["speedup"],
        speedup_max=claim["high"] if claim.get("high") is not None else claim["speedup"],
        artifacts={k: str(out / v["path"]) for k, v in summary.get("artifacts", {}).items() if v.get("status") == "ok"},
        study=study,
        out_dir=out,
        stop_reason=stop_reason,
        verdict=claim["verdict"],
        claimed=claimed,
        claim=claim["sentence"],
    )
    report.write_json(
        out / "best_config.json",
        {
            "schema_version": report.SCHEMA_VERSION,
            "created": report.now_iso(),
            **summary,
            "config": dict(best["config"]),
            "baseline_config": baseline["config"],
            "best": result.best,
            "baseline": result.baseline,
            "speedup": claim,
            # The winner's int8 layers kept float, with their measured error: apply() reuses them.
            "int8": _int8_record(best),
            "rebuild": rebuild or summary.get("rebuild"),
            "trial_figures": {
                "best": {k: best.get(k) for k in ("samples_per_s", "latency_ms_p95", "cov", "noisy")},
                "baseline": {k: baseline.get(k) for k in ("samples_per_s", "latency_ms_p95", "cov", "noisy")},
                "notes": notes,
            },
            "trial": best["number"],
            # Every entry of the study, and apart from it what the terminal and the reports count:
            # the trials measured, and the repeats answered from an earlier measurement.
            "n_trials": len(study.trials) if study is not None else None,
            **_counts(study),
            "stop_reason": stop_reason,
            "artifacts": summary.get("artifacts", {}),
        },
    )
    result.held_out = summary.get("held_out")
    result.diagnosis = summary.get("diagnosis")
    result.profile = summary.get("profile")
    result.search = summary.get("search")
    result.notes = notes
    return result
