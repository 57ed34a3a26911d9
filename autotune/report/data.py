"""A finished run read back from its output directory: ``best_config.json``, the study in its
storage, ``trials.csv`` and ``pareto.json``. Nothing is measured again.

The report, ``autotune show`` and ``autotune dashboard`` all start here.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any

from autotune.errors import InputError
from autotune.report.summary import trial_counts

__all__ = ["RunFiles", "load_result", "load_run", "read_best", "run_summary", "storage_of", "trial_counts"]


@dataclasses.dataclass
class RunFiles:
    """What a run left in its output directory.

    Attributes:
        out_dir: The output directory.
        best: The contents of ``best_config.json``.
        records: One flat dict per trial (as :func:`autotune.record.trial_record` makes them),
            from the study, or from ``trials.csv`` when the study cannot be opened.
        study: The Optuna study, or ``None`` when its storage cannot be opened.
        study_error: Why the study could not be opened, if it could not.
        pareto: The contents of ``pareto.json``, if the run had several objectives.
    """

    out_dir: Path
    best: dict[str, Any]
    records: list[dict[str, Any]]
    study: Any = None
    study_error: str | None = None
    pareto: dict[str, Any] | None = None

    @property
    def objectives(self) -> list[str]:
        """The run's objectives, first one first."""
        return list(self.best.get("objectives") or ["throughput"])

    def status_counts(self) -> dict[str, int]:
        """Measured trials by status, in a fixed order (repeats and trials not run left out)."""
        return trial_counts(self.records)["by_status"]

    def trial_counts(self) -> dict[str, Any]:
        """:func:`trial_counts` of the run's trials."""
        return trial_counts(self.records)


def read_best(out_dir: str | Path) -> dict[str, Any]:
    """The contents of ``OUT_DIR/best_config.json``.

    Raises:
        InputError: the file is missing or not JSON.
    """
    path = Path(out_dir) / "best_config.json"
    if not path.is_file():
        raise InputError(
            f"No best_config.json in {out_dir}: give the output directory of a finished run (autotune run --out DIR)."
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON ({exc}); re-run the search or restore the file.") from None


def storage_of(out_dir: str | Path, best: dict[str, Any] | None = None) -> tuple[str, str]:
    """(storage URL, Optuna study name) of the run in ``out_dir``.

    The storage recorded in ``best_config.json`` wins; a SQLite file that has moved with its
    output directory (copied to another machine, say) is found as ``OUT_DIR/study.db``. A
    password is not recorded (``***``): pass the storage URL yourself where one is needed.

    Raises:
        InputError: neither ``best_config.json`` nor ``study.db`` is in ``out_dir``.
    """
    out = Path(out_dir)
    local = out / "study.db"
    if best is None and (out / "best_config.json").is_file():
        best = read_best(out)
    if best is None:
        if not local.is_file():
            raise InputError(
                f"No best_config.json or study.db in {out_dir}: give the output directory of a run (autotune run --out DIR)."
            )
        return f"sqlite:///{local.resolve()}", "autotune"
    study = best.get("study") or {}
    # With studies shared across hardware, each hardware group has its own Optuna study.
    storage, name = study.get("storage"), study.get("optuna_study") or study.get("name") or "autotune"
    recorded = storage[len("sqlite:///") :] if storage and storage.startswith("sqlite:///") else None
    if storage is None or (recorded is not None and not Path(recorded).is_file() and local.is_file()):
        storage = f"sqlite:///{local.resolve()}"
    return storage, name


def _number(text: str) -> Any:
    if text in ("", None):
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _records_from_csv(path: Path) -> list[dict[str, Any]]:
    from autotune.knobs import REGISTRY

    if not path.is_file():
        return []
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    records = []
    for row in rows:
        rec = {k: _number(v) for k, v in row.items() if k not in REGISTRY}
        rec["config"] = {k: _number(v) for k, v in row.items() if k in REGISTRY}
        records.append(rec)
    return records


def load_run(out_dir: str | Path, study: Any = None) -> RunFiles:
    """Read the run in ``out_dir``; pass ``study`` when it is already open.

    Raises:
        InputError: ``best_config.json`` is missing or unreadable.
    """
    out = Path(out_dir)
    best = read_best(out)
    error = None
    if study is None:
        try:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            storage, name = storage_of(out, best)
            study = optuna.load_study(study_name=name, storage=storage)
        except Exception as exc:  # the files alone still make a report
            study, error = None, f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if study is not None:
        from autotune.record import trial_record

        records = [trial_record(t) for t in study.get_trials(deepcopy=False)]
    else:
        records = _records_from_csv(out / "trials.csv")
    pareto_path = out / "pareto.json"
    pareto = json.loads(pareto_path.read_text()) if pareto_path.is_file() else None
    return RunFiles(out, best, records, study, error, pareto)


def load_result(out_dir: str | Path) -> Any:
    """The :class:`~autotune.Result` of the finished run in ``out_dir``, from its files."""
    from autotune.record import Result

    run = load_run(out_dir)
    best, speedup = run.best, run.best.get("speedup") or {}
    artifacts = best.get("artifacts") or {}
    value = speedup.get("speedup", speedup.get("median", 1.0))  # runs written before the claim had "median"
    low, high = speedup.get("low", speedup.get("min")), speedup.get("high", speedup.get("max"))
    verdict = speedup.get("verdict", "speedup")
    return Result(
        best_config=dict(best.get("config") or {}),
        best=dict(best.get("best") or {}),
        baseline=dict(best.get("baseline") or {}),
        speedup=value,
        speedup_min=low if low is not None else value,
        speedup_max=high if high is not None else value,
        artifacts={k: str(run.out_dir / v["path"]) for k, v in artifacts.items() if v.get("status") == "ok"},
        study=run.study,
        out_dir=run.out_dir,
        stop_reason=best.get("stop_reason") or "unknown",
        pareto=list((run.pareto or {}).get("front") or []),
        held_out=best.get("held_out"),
        diagnosis=best.get("diagnosis"),
        profile=best.get("profile"),
        search=best.get("search"),
        verdict=verdict,
        claimed=verdict == "speedup" or speedup.get("method") == "baseline is best",
        claim=speedup.get("sentence", ""),
        notes=list((best.get("trial_figures") or {}).get("notes") or []),
    )


def changed_knobs(best: dict[str, Any]) -> dict[str, Any]:
    """The winner's knobs whose values differ from the baseline's (and matter given the others)."""
    from autotune.knobs import REGISTRY

    base, config = best.get("baseline_config") or {}, best.get("config") or {}
    return {k: v for k, v in config.items() if base.get(k) != v and (k not in REGISTRY or REGISTRY[k].applies(config))}


def run_summary(out_dir: str | Path) -> dict[str, Any]:
    """The JSON-safe summary of a finished run that ``autotune show --json`` and
    ``autotune run --json`` print."""
    run = load_run(out_dir)
    best, counts = run.best, run.trial_counts()
    reports = {name: str(run.out_dir / name) for name in ("report.html", "report.md") if (run.out_dir / name).is_file()}
    return {
        "out_dir": str(run.out_dir),
        "speedup": best.get("speedup"),
        "objectives": run.objectives,
        "baseline": best.get("baseline"),
        "best": best.get("best"),
        "config": best.get("config"),
        "changed": changed_knobs(best),
        "trial": best.get("trial"),
        # The trials measured, as the terminal counted them; the study's other entries apart.
        "n_trials": counts["n_measured"],
        "trials_by_status": counts["by_status"],
        "n_repeats": counts["n_repeats"],
        "n_not_measured": counts["n_not_measured"],
        "stop_reason": best.get("stop_reason"),
        "diagnosis": best.get("diagnosis"),
        "search": best.get("search"),
        "held_out": best.get("held_out"),
        "artifacts": best.get("artifacts") or {},
        "pareto": (run.pareto or {}).get("front"),
        "study": best.get("study"),
        "reports": reports,
    }
