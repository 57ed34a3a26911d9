"""The result files of a search: ``best_config.json`` (the claim, the figures shown for the
winner and the baseline, the int8 record, what :func:`autotune.apply` needs to rebuild the
winner) with the :class:`~autotune.record.Result` it stands for, ``pareto.json``, and the files
of each hardware group of a study measured on several kinds of hardware (``by_hardware/``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.config import values_of
from autotune.record import Result

__all__ = ["figures_note", "write_best", "write_hardware_groups", "write_pareto"]


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
    from autotune.knobs.compress import int8_method

    if "int8_kept" not in best and "float_bytes" not in best:
        return None
    errors, scores = best.get("int8_kept_error"), best.get("int8_kept_score")
    config = best.get("config") or {}
    # An exported runtime quantizes on its side: its precision knob says how (NNCF static int8 for OpenVINO).
    runtime, method = int8_method(config)
    return {
        "method": method,
        "runtime": runtime,
        # Dynamic int8 scales weights per tensor unless asked; the other methods per channel.
        "per_channel": bool(values_of(config).int8_per_channel) or method != "int8_dynamic",
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
    from autotune.record import trial_record
    from autotune.report.summary import trial_counts

    counts = trial_counts([trial_record(t) for t in study.get_trials(deepcopy=False)])
    return {"n_measured": counts["n_measured"], "n_repeats": counts["n_repeats"]}


def _rebuild_record(summary: dict[str, Any], best: dict[str, Any]) -> dict[str, Any] | None:
    """For a winner built from example inputs (int8, pruned, another runtime), what
    :func:`autotune.apply` needs to rebuild the very model measured: the run's calibration draw,
    the layers it kept float, and the batches themselves where the export kept them
    (``inputs``, a file in the run's folder; ``None`` for any other winner)."""
    from autotune.knobs.compress import is_int8

    inputs = summary.get("build_inputs") or {}
    int8 = is_int8(best.get("config") or {})
    if not summary.get("rebuild") or not (int8 or inputs.get("path")):
        return None
    kept = best.get("int8_kept") if best.get("int8_layers") else None
    kept = json.loads(kept) if isinstance(kept, str) else kept
    record = {**summary["rebuild"], "int8_kept_float": list(kept) if isinstance(kept, (list, tuple)) else None}
    if inputs.get("path"):
        record.update(inputs=inputs["path"], ragged=inputs.get("ragged", 0), calibrated=inputs.get("calibration"))
    return record


def _located(rebuild: dict[str, Any], out: Path) -> dict[str, Any]:
    """``rebuild`` with its inputs' file named by its whole path: ``result.best_config`` travels
    without the run's folder."""
    return {**rebuild, "inputs": str(out.resolve() / rebuild["inputs"])} if rebuild.get("inputs") else rebuild


def _run_claim(
    summary: dict[str, Any],
    baseline: dict[str, Any],
    best: dict[str, Any],
    confirmed: dict[str, Any] | None,
    interrupted: bool,
    why_unconfirmed: str | None,
) -> dict[str, Any]:
    """The run's ``speedup`` entry (:func:`_claim_fields`): a finalist's failed or late
    confirmation is its verdict, and a winner with the decoded-sample cache says what it assumes."""
    from autotune.knobs import REGISTRY, off_default

    finalists = [f for f in summary.get("finalists") or [] if isinstance(f, dict)]
    failed = [f["error"] for f in finalists if f.get("failed")]
    late = [f["error"] for f in finalists if f.get("deadline")]
    if late and why_unconfirmed is None:
        why_unconfirmed = f"deadline ({late[0]})"
    claim = _claim_fields(baseline, best, confirmed, interrupted, why_unconfirmed, failed[0] if failed else None)
    config = best.get("config") or {}
    repeats = off_default(config, "pays_on_repeats")
    if repeats and summary.get("mode") != "train":
        # Measured over passes that read the same samples again: true only where use does too.
        what = REGISTRY[repeats[0]].pays_on_repeats
        claim["assumes"] = f"the same samples are read again (repeated_passes): {what} pays there"
        claim["sentence"] += f"; assuming the same samples are read again, as {what} needs"
    for name in off_default(config, "claim_note"):  # what was measured is not what the user's code alone does
        key, words, short = REGISTRY[name].claim_note
        claim[key] = words
        claim["sentence"] += f"; with {short}"
    return claim


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
    from autotune.knobs.distributed import launch_record

    claim = _run_claim(summary, baseline, best, confirmed, interrupted, why_unconfirmed)
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
        best_config={**best["config"], "rebuild": _located(rebuild, out)} if rebuild else dict(best["config"]),
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
            # A winner that trains in several processes: the torchrun commands and DDP settings.
            "launch": launch_record(dict(best["config"]), best),
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


def write_hardware_groups(
    out: Path, study: Any, summary: dict[str, Any], objectives: Sequence[str], select: Any
) -> dict[str, str]:
    """For a study measured on several kinds of hardware, write ``by_hardware/<slug>/`` per group.

    Each group's folder holds its ``trials.csv`` and ``best_config.json``. This machine's group
    gets a copy of ``best_config.json`` (verified here); another group's winner is its own best
    measurement against its own baseline, unverified here (it cannot be re-measured on this
    hardware), stamped with that group's environment.

    Returns:
        Folder by hardware key; empty when the study has one group (nothing is written).
    """
    import optuna

    import autotune.report.summary as report
    from autotune.record import trial_record
    from autotune.run.rounds import baseline_and_best
    from autotune.search.storage import family, hardware_slug, storage_of

    storage = storage_of(study)
    members = family(storage, summary["study"]["name"])
    if len(members) < 2:
        return {}
    written = {}
    for member in members:
        hardware = member.user_attrs.get("hardware", "unknown")
        folder = out / "by_hardware" / hardware_slug(hardware)
        folder.mkdir(parents=True, exist_ok=True)
        written[hardware] = str(folder)
        if member.study_name == study.study_name:
            for name in ("best_config.json", "trials.csv"):
                if (out / name).exists():
                    shutil.copyfile(out / name, folder / name)
            continue
        group = optuna.load_study(study_name=member.study_name, storage=storage)
        report.write_trials_csv(folder / "trials.csv", [trial_record(t) for t in group.get_trials(deepcopy=False)])
        group_objectives = member.user_attrs.get("objectives") or list(objectives)
        picked = baseline_and_best(group, group_objectives, select, required=False)
        if picked is None:
            continue  # no baseline measured there yet
        drop = ("finalists", "diagnosis", "held_out", "artifacts")
        group_summary = {k: v for k, v in summary.items() if k not in drop}
        group_summary.update(
            env=member.user_attrs.get("env", {}),
            objectives=group_objectives,
            study={**summary["study"], "optuna_study": member.study_name, "hardware": hardware},
        )
        write_best(folder, group_summary, *picked, confirmed=None, stop_reason="measured elsewhere", study=group,
                   why_unconfirmed="measured by other workers, on hardware this one is not")  # fmt: skip
    return written
