"""``optimize``, ``apply`` and ``dataloader``: the Python API's verbs."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import Config
from .errors import ConfigError, InputError

__all__ = ["Result", "optimize", "apply", "dataloader", "plan"]

_DEFAULT_MEASURE = {"n_windows": 5, "window_s": 0.4, "warmup_batches": 3}


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
        artifacts: Exported files by format (none yet in this version).
        study: The Optuna study with every trial.
        out_dir: Where ``best_config.json``, ``trials.csv`` and ``study.db`` were written.
        stop_reason: ``"budget"``, ``"timeout"`` or ``"exhausted"`` (every configuration measured).
        pareto: With several objectives, the feasible Pareto front (also in ``pareto.json``).
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

    def __repr__(self) -> str:
        return (
            f"Result(speedup={self.speedup:.2f}x [{self.speedup_min:.2f}-{self.speedup_max:.2f}], "
            f"best_config={self.best_config}, out_dir={str(self.out_dir)!r})"
        )


def _check_options(
    n_trials: Any,
    timeout: Any,
    max_metric_drop: Any,
    isolation: str,
    trial_timeout: Any,
    n_val: Any,
    baseline_batch_size: Any,
    mode: str,
    metric: Any,
) -> None:
    def positive_int(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"`{name}` must be a positive integer, but got {value!r}.")

    positive_int("n_trials", n_trials)
    positive_int("n_val", n_val)
    positive_int("baseline_batch_size", baseline_batch_size)
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
        raise ConfigError(f"`timeout` must be a positive number of seconds or None, but got {timeout!r}.")
    if not isinstance(trial_timeout, (int, float)) or isinstance(trial_timeout, bool) or trial_timeout <= 0:
        raise ConfigError(f"`trial_timeout` must be a positive number of seconds, but got {trial_timeout!r}.")
    if (
        not isinstance(max_metric_drop, (int, float))
        or isinstance(max_metric_drop, bool)
        or not 0 <= max_metric_drop <= 1
    ):
        raise ConfigError(f"`max_metric_drop` must be in [0, 1], but got {max_metric_drop!r}.")
    if isolation not in ("subprocess", "inprocess"):
        raise ConfigError(f"`isolation` must be 'subprocess' or 'inprocess', but got {isolation!r}.")
    if mode != "inference":
        raise ConfigError(f"`mode` must be 'inference' (training mode is not available yet), but got {mode!r}.")
    if metric is not None and not callable(metric):
        raise ConfigError(
            f"`metric` must be a function metric(outputs, batch) -> float, but got {type(metric).__name__}."
        )


def _materialize_dataset(dataset: Any) -> Any:
    if callable(dataset) and not hasattr(dataset, "__getitem__"):
        try:
            return dataset()
        except Exception as exc:
            raise InputError(f"The dataset factory raised {type(exc).__name__}: {exc}") from exc
    return dataset


def _check_model(model: Any) -> None:
    import torch

    if isinstance(model, torch.nn.Module):
        return
    if not callable(model) or (isinstance(model, type) and not issubclass(model, torch.nn.Module)):
        raise InputError(
            f"`model` must be a torch.nn.Module or a zero-argument function returning one, but got {type(model).__name__}."
        )


def plan(
    model: Any,
    dataset: Any,
    *,
    space: Any = "default",
    fix: Mapping[str, Any] | None = None,
    device: str = "auto",
    baseline_batch_size: int = 32,
) -> tuple[Any, Any, Any]:
    """Check the inputs and resolve the search space without measuring anything.

    Returns:
        ``(env, data_info, search_space)``; ``search_space.excluded`` says why each value left
        out was left out.
    """
    from .data import describe
    from .env import Env
    from .knobs import SpaceContext
    from .space import resolve_space

    _check_model(model)
    data = describe(_materialize_dataset(dataset))
    env = Env.detect(device)
    ctx = SpaceContext(env=env, data=data, baseline_batch_size=baseline_batch_size)
    return env, data, resolve_space(space, ctx, fix)


def optimize(
    model: Any,
    dataset: Any,
    *,
    mode: str = "inference",
    space: str | Path | Mapping[str, Any] = "default",
    metric: Callable[[Any, Any], float] | None = None,
    max_metric_drop: float = 0.01,
    objectives: Sequence[str] = ("throughput",),
    n_trials: int = 30,
    timeout: float | None = None,
    device: str = "auto",
    out_dir: str | Path = "autotune-out",
    storage: str | None = None,
    study_name: str | None = None,
    resume: bool = False,
    fix: Mapping[str, Any] | None = None,
    seed: int = 0,
    baseline_batch_size: int = 32,
    trial_timeout: float = 600.0,
    isolation: str = "subprocess",
    n_val: int = 512,
    measure: Mapping[str, Any] | None = None,
    n_verify_pairs: int = 5,
    n_finalists: int = 3,
    select: Any = None,
    sampler: Any = None,
    progress: Callable[[dict[str, Any], int, int], None] | None = None,
) -> Result:
    """Search for the fastest configuration of ``model`` on ``dataset`` whose accuracy holds.

    Args:
        model: An ``nn.Module`` or a zero-argument function returning one.
        dataset: A map-style dataset or sequence of samples (or a function returning one).
        mode: ``"inference"``.
        space: Preset name (``autotune spaces`` lists them), a TOML file, or a dict of knob
            values on top of a preset (see :func:`autotune.space.resolve_space`).
        metric: ``metric(outputs, batch) -> float``, higher is better; without it, fidelity to
            the baseline's outputs is the metric.
        max_metric_drop: Largest allowed drop of the metric below the baseline's (absolute).
        objectives: What to optimize: ``("throughput",)``.
        n_trials: Measured trials in the study (a resumed study counts its earlier ones).
        timeout: Seconds for this call's search; ``None`` for no limit.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        out_dir: Directory of the result files.
        storage: Optuna storage URL; default ``sqlite:///<out_dir>/study.db``.
        study_name: Default ``"autotune"``.
        resume: Continue an existing study instead of refusing to touch it.
        fix: Knobs pinned to one value, e.g. ``{"amp_dtype": "bfloat16"}``.
        seed: Seeds the sampler and torch.
        baseline_batch_size: Batch size of the baseline (your current one).
        trial_timeout: Seconds one trial may take before its worker is killed.
        isolation: ``"subprocess"`` (a worker process, restarted after faults) or ``"inprocess"``.
        n_val: Samples in the fixed validation subset of the guard.
        measure: Timing settings: ``n_windows``, ``window_s``, ``warmup_batches``.
        n_verify_pairs: Rounds of the final interleaved re-measurement (one baseline/finalist
            pair per finalist and round).
        n_finalists: Best trials re-measured against the baseline before the winner is chosen:
            one measurement per trial can flatter a configuration by chance.
        select: With several objectives, which member of the feasible Pareto front wins: an
            objective name, or a function of the front's records returning one; default the
            highest throughput.
        sampler: An Optuna sampler to use instead of the seeded TPE sampler.
        progress: Called after each trial with (trial record, trials measured, n_trials).

    Returns:
        A :class:`Result`.

    Example:
        >>> import torch, autotune
        >>> data = [(torch.randn(16), 0) for _ in range(256)]
        >>> result = autotune.optimize(torch.nn.Linear(16, 4), data, space="quick", n_trials=3,
        ...                            out_dir="/tmp/autotune-doc")  # doctest: +SKIP
    """
    from . import _select, report
    from ._worker import WorkerSpec
    from .data import validation_indices
    from .measure import MeasureSettings
    from .runner import InProcessRunner, SubprocessRunner, pickle_spec
    from .study import open_study, run_trials, trial_record

    _check_options(
        n_trials, timeout, max_metric_drop, isolation, trial_timeout, n_val, baseline_batch_size, mode, metric
    )
    objectives = _select.check_objectives(objectives)
    _select.check_select(select)
    try:
        timing = MeasureSettings(**{**_DEFAULT_MEASURE, **dict(measure or {})})
    except TypeError as exc:
        raise ConfigError(f"`measure` takes n_windows, window_s and warmup_batches: {exc}.") from None
    dataset = _materialize_dataset(dataset)
    env, data, search_space = plan(
        model, dataset, space=space, fix=fix, device=device, baseline_batch_size=baseline_batch_size
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    storage = storage or f"sqlite:///{out.resolve() / 'study.db'}"
    study_name = study_name or "autotune"
    study = open_study(storage, study_name, objectives, seed, resume, sampler)

    spec = WorkerSpec(
        model=model,
        dataset=dataset,
        metric=metric,
        device=env.device,
        baseline=search_space.baseline,
        val_indices=validation_indices(data.n_samples, n_val),
        measure=timing,
        seed=seed,
    )
    if isolation == "inprocess":
        runner = InProcessRunner(spec)
    else:
        runner = SubprocessRunner(pickle_spec(spec), trial_timeout, out / "logs" / "worker.log")

    def after_trial(record: dict[str, Any], n_done: int) -> None:
        report.write_trials_csv(out / "trials.csv", [trial_record(t) for t in study.get_trials(deepcopy=False)])
        if progress is not None:
            progress(record, n_done, n_trials)

    summary = {
        "env": env.manifest(),
        "mode": mode,
        "guard": {"metric": "user" if metric is not None else "fidelity", "max_metric_drop": max_metric_drop},
        "objectives": list(objectives),
        "study": {"name": study_name, "storage": storage},
        "space": search_space.values,
    }
    try:
        stop_reason = run_trials(
            study,
            runner,
            search_space,
            n_trials=n_trials,
            timeout=timeout,
            max_metric_drop=max_metric_drop,
            objectives=objectives,
            extra_attrs={"hardware": env.hardware_key()},
            on_trial=after_trial,
        )
        baseline, best = _baseline_and_best(study, objectives, select)
        ratios = None
        records = [trial_record(t) for t in study.get_trials(deepcopy=False)]
        front = _write_pareto(out, records, objectives) if len(objectives) > 1 else []
        finalists = _select.finalists(records, objectives, baseline["key"], n_finalists, select)
        if finalists:
            speed_only = list(objectives) == ["throughput"]
            best, ratios, summary["finalists"] = _verify(runner, baseline, finalists, n_verify_pairs, speed_only)
    except KeyboardInterrupt:
        # Keep what was found so far; the ratio then comes from the two trials, unverified.
        picked = _baseline_and_best(study, objectives, select, required=False)
        if picked is not None:
            _write_best(out, summary, *picked, ratios=None, stop_reason="interrupted", study=study)
        raise
    finally:
        runner.close()
        report.write_trials_csv(out / "trials.csv", [trial_record(t) for t in study.get_trials(deepcopy=False)])
    result = _write_best(out, summary, baseline, best, ratios=ratios, stop_reason=stop_reason, study=study)
    result.pareto = front
    return result


def _baseline_and_best(study: Any, objectives: Sequence[str], select: Any, required: bool = True) -> Any:
    from ._select import choose
    from .study import trial_record

    records = [trial_record(t) for t in study.get_trials(deepcopy=False)]
    baseline = next((r for r in records if r.get("baseline") and r.get("status") == "ok"), None)
    if baseline is None:
        if required:
            raise InputError("The baseline was never measured successfully; see trials.csv for why.")
        return None
    return baseline, choose(records, objectives, select) or baseline


def _verify(
    runner: Any, baseline: dict[str, Any], finalists: list[dict[str, Any]], n_rounds: int, speed_only: bool
) -> tuple[dict[str, Any], list[float] | None, list[dict[str, Any]]]:
    """Re-measure the finalists interleaved with the baseline; return (winner, its ratios, table).

    When speed is the only objective and no finalist beats the baseline on re-measurement, the
    baseline wins; with other objectives (size, say) a slower winner can still be the right one.
    """
    from .errors import TrialError

    try:
        rounds = runner.verify(baseline["config"], [f["config"] for f in finalists], n_rounds)
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


def _write_pareto(out: Path, records: list[dict[str, Any]], objectives: Sequence[str]) -> list[dict[str, Any]]:
    """Write ``pareto.json``: the feasible Pareto front, best first on the first objective."""
    from . import report
    from ._select import pareto_front

    front = [
        {"trial": r["number"], "config": r["config"], **{k: r.get(k) for k in (*report.METRIC_KEYS, "batch_size")}}
        for r in pareto_front(records, objectives)
    ]
    report.write_json(out / "pareto.json", {"objectives": list(objectives), "front": front})
    return front


def _write_best(
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
    keys = (*report.METRIC_KEYS, "batch_size")
    result = Result(
        best_config=dict(best["config"]),
        best={k: best.get(k) for k in keys},
        baseline={k: baseline.get(k) for k in keys},
        speedup=statistics.median(ratios),
        speedup_min=min(ratios),
        speedup_max=max(ratios),
        artifacts={},
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
            "artifacts": {},
        },
    )
    return result


def _read_config(config: Any) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "best_config.json"
        if not path.is_file():
            raise ConfigError(f"No config at {str(path)!r}: give a dict, a best_config.json or its directory.")
        return Config.from_json(path.read_text())
    if isinstance(config, Mapping):
        return Config(config)
    raise ConfigError(
        f"`config` must be a dict, a Config or a path to best_config.json, but got {type(config).__name__}."
    )


def apply(model: Any, config: Any, *, device: str = "auto") -> Any:
    """Return ``model`` tuned as ``config`` says (a copy; the original is untouched).

    The returned module takes the same inputs and returns float32 outputs. Process-wide
    settings in the config (``num_threads``, ``cudnn_benchmark``, ``tf32``) are applied to this
    process.

    Example:
        >>> import torch
        >>> fast = apply(torch.nn.Linear(4, 2), {"amp_dtype": "bfloat16"}, device="cpu")
        >>> fast(torch.randn(3, 4)).dtype
        torch.float32
    """
    import torch

    from .build import apply_settings, build
    from .env import resolve_device

    _check_model(model)
    if not isinstance(model, torch.nn.Module):
        model = model()
    cfg = _read_config(config)
    state = build(model, cfg, resolve_device(device))
    apply_settings(state.settings)
    return state.model


def dataloader(dataset: Any, config: Any, **overrides: Any) -> Any:
    """A DataLoader with the tuned batch size and loader settings.

    Args:
        dataset: The dataset.
        config: A dict, :class:`Config`, ``best_config.json`` or its directory.
        **overrides: Any other DataLoader argument (``shuffle=True`` for training, say).

    Example:
        >>> import torch
        >>> loader = dataloader([torch.zeros(3)] * 10, {"batch_size": 4})
        >>> [b.shape[0] for b in loader]
        [4, 4, 2]
    """
    import torch

    from .build import BuildState

    cfg = _read_config(config)
    state = BuildState(model=None, device="cpu")
    from .knobs import REGISTRY, Stage

    for knob in REGISTRY.values():
        if knob.stage == Stage.LOADER:
            knob.apply(state, cfg[knob.name])
    if state.loader_kwargs.get("pin_memory") and not torch.cuda.is_available():
        state.loader_kwargs["pin_memory"] = False
    return torch.utils.data.DataLoader(dataset, **{**state.loader_kwargs, **overrides})
