"""Progress of a study while its workers run: trials per state, per worker and per hardware
group, and the best configuration so far. Reads the storage only; safe to call at any time.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = ["out_dir_status", "study_status"]


def _names(storage: Any) -> list[str]:
    """The studies of a storage, as the user named them (one per family of hardware groups)."""
    return sorted({s.user_attrs.get("family") or s.study_name for s in storage.get_all_studies()})


def _when(value: Any) -> str | None:
    return value.isoformat(timespec="seconds") if value is not None else None


def _group(storage: Any, member: Any) -> dict[str, Any]:
    from autotune.record import trial_record
    from autotune.search.select import OBJECTIVES, choose

    trials = storage.get_all_trials(storage.get_study_id_from_name(member.study_name), deepcopy=False)
    objectives = member.user_attrs.get("objectives") or ["throughput"]
    records = [trial_record(t) for t in trials]
    measured = [r for r in records if r.get("ran") and r.get("repeat_of") is None and r.get("status")]
    measured_numbers = {r["number"] for r in measured}
    workers: dict[str, dict[str, Any]] = {}
    for trial, rec in zip(trials, records, strict=True):
        entry = workers.setdefault(
            rec.get("worker") or "unknown", {"states": Counter(), "n_measured": 0, "running": [], "last_at": None}
        )
        entry["states"][trial.state.name] += 1
        entry["n_measured"] += rec["number"] in measured_numbers
        if trial.state.name == "RUNNING":
            entry["running"].append(trial.number)
        stamp = trial.datetime_complete or trial.datetime_start
        if stamp is not None and (entry["last_at"] is None or stamp.isoformat() > entry["last_at"]):
            entry["last_at"] = _when(stamp)
    baseline = next((r for r in measured if r.get("baseline") and r["status"] == "ok"), None)
    best = choose(records, objectives) if baseline is not None else None
    keys = [OBJECTIVES[o][0] for o in objectives]

    def brief(rec: dict[str, Any] | None) -> dict[str, Any] | None:
        if rec is None:
            return None
        out = {"trial": rec["number"], "config": rec.get("config"), **{k: rec.get(k) for k in keys}}
        if baseline is not None and rec.get("samples_per_s") and baseline.get("samples_per_s"):
            # The two trials' own figures: what the run claims comes from its confirmation rounds.
            out["trial_ratio"] = rec["samples_per_s"] / baseline["samples_per_s"]
        return out

    return {
        "hardware": member.user_attrs.get("hardware", "unknown"),
        "optuna_study": member.study_name,
        "objectives": list(objectives),
        "n_trials": len(trials),
        "n_requested": member.user_attrs.get("n_trials"),
        "n_measured": len(measured),
        "states": dict(Counter(t.state.name for t in trials)),
        "statuses": dict(Counter(r["status"] for r in records if r.get("status"))),
        "workers": {w: {**e, "states": dict(e["states"])} for w, e in sorted(workers.items())},
        "running": [
            {
                "trial": t.number,
                "worker": r.get("worker"),
                "config": r.get("config"),
                "started": _when(t.datetime_start),
            }
            for t, r in zip(trials, records, strict=True)
            if t.state.name == "RUNNING"
        ],
        "retried": [
            {"trial": r["number"], "retry_of": r["retry_of"]} for r in records if r.get("retry_of") is not None
        ],
        "baseline": brief(baseline),
        "best": brief(best),
    }


def study_status(storage: str, study_name: str | None = None) -> dict[str, Any]:
    """The progress of a (possibly shared, possibly running) study.

    Args:
        storage: The study's database URL.
        study_name: The study's name; may be left out when the storage holds only one.

    Returns:
        ``{"study", "storage" (password hidden), "groups": [...]}`` with one group per hardware:
        ``hardware``, ``optuna_study``, ``n_trials``, ``n_requested`` (the budget the latest
        worker asked for), ``n_measured``, ``states`` and ``statuses`` (counts), ``workers``
        (per worker id: ``states``, ``n_measured``, ``running`` trial numbers, ``last_at``),
        ``running`` and ``retried`` trials, and the ``baseline`` and ``best`` so far (trial,
        config, objective metrics, ``trial_ratio``: the trials' own throughput ratio, not a
        claim). :func:`out_dir_status` adds the finished run's ``claim`` (best_config.json's
        ``speedup``: the one figure the run reports everywhere).

    Raises:
        ConfigError: the storage cannot be opened, holds no such study, or holds several and
            ``study_name`` was not given.

    Example:
        >>> study_status("sqlite:///autotune-out/study.db")["groups"][0]["n_measured"]  # doctest: +SKIP
        12
    """
    from autotune.search.storage import family, open_storage, redact

    opened = open_storage(storage)
    names = _names(opened)
    if study_name is None:
        if len(names) != 1:
            known = ", ".join(names) or "none"
            raise ConfigError(f"{redact(storage)} holds {len(names)} studies ({known}); pass --study NAME.")
        study_name = names[0]
    members = family(opened, study_name)
    if not members:
        raise ConfigError(f"No study named {study_name!r} in {redact(storage)}. Known: {', '.join(names) or 'none'}.")
    groups = [_group(opened, m) for m in sorted(members, key=lambda m: m.study_name)]
    return {"study": study_name, "storage": redact(storage), "groups": groups}


def out_dir_status(out_dir: str | Path, study_name: str | None = None) -> dict[str, Any]:
    """:func:`study_status` of the study in an output directory's ``study.db``.

    Raises:
        ConfigError: the directory has no ``study.db`` (a shared study lives in its database:
            give its URL instead).
    """
    import json

    db = Path(out_dir) / "study.db"
    if not db.is_file():
        raise ConfigError(f"No study.db in {out_dir}. For a study in another database pass --storage URL --study NAME.")
    data = study_status(f"sqlite:///{db.resolve()}", study_name)
    best_path = Path(out_dir) / "best_config.json"
    if best_path.is_file():
        try:
            best = json.loads(best_path.read_text())
        except (OSError, ValueError):
            return data
        ran = (best.get("study") or {}).get("optuna_study")
        for group in data["groups"]:
            if group["optuna_study"] == ran:
                group["claim"] = best.get("speedup")
    return data
