"""``collect``: the one winner of a study that workers on several machines shared.

Every worker of a shared study ends like a single run: it re-measures the best trials against
the baseline on its own machine, so two machines can name different winners when the finalists
are within each other's noise. :func:`collect` runs that finish once, on one machine, over the
trials every worker stored: it measures no new trial, picks among the finalists on fresh
rounds, confirms the pick against the baseline, exports it and writes the result files.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.record import Result
    from autotune.run.options import Options

__all__ = ["collect", "collect_options"]

# Options a collect sets itself: it joins the study with exactly its measured trials as the budget.
_SET_HERE = ("n_trials", "join", "resume", "devices")


def collect(
    model: Any,
    dataset: Any,
    storage: str,
    study_name: str = "autotune",
    out_dir: str | Path = "autotune-out",
    **options: Any,
) -> Result:
    """Pick the one winner of a shared study and write its result files and artifacts, once.

    Run it on one machine when the workers are done, with the model and dataset they tuned
    (their cfg.py) on hardware like theirs: the finalists are re-measured here against the
    baseline, so its claim is this machine's, and only the trials of this machine's hardware
    group are candidates.

    Args:
        model: The model the workers tuned.
        dataset: The dataset they tuned it on.
        storage: The study's database URL, as the workers were given it.
        study_name: The study's name.
        out_dir: Where ``best_config.json``, the artifacts and the reports go.
        **options: Other :func:`autotune.optimize` keywords, as the workers had them (``metric``,
            ``space``, ``fix``, ``export``, ``timeout``, ...); not ``n_trials``, ``join``,
            ``resume`` or ``devices``, which a collect sets itself.

    Returns:
        The :class:`~autotune.record.Result`, as :func:`autotune.optimize` returns it.

    Raises:
        ConfigError: no such study, none of its trials was measured on this machine's hardware,
            or some are still running.

    Example:
        >>> result = autotune.collect(model, dataset, "postgresql://tuner@db/autotune",
        ...                           study_name="resnet50-serving", out_dir="winner")  # doctest: +SKIP
    """
    from autotune.run.options import Options

    given = [name for name in _SET_HERE if name in options]
    if given:
        raise ConfigError(
            f"collect sets {', '.join(given)} itself (it joins the study and measures no new trial); leave "
            f"{'them' if len(given) > 1 else 'it'} out."
        )
    opts = Options(storage=storage, study_name=study_name, out_dir=out_dir, join=True, **options)
    return collect_options(model, dataset, opts)


def collect_options(model: Any, dataset: Any, opts: Options) -> Result:
    """:func:`collect` with its options already built (``autotune collect`` builds them from a
    cfg.py and its flags); ``n_trials``, ``join``, ``resume`` and ``devices`` are set here."""
    if opts.storage is None:
        raise ConfigError("collect needs the study's `storage` URL (CLI: --storage URL), as the workers were given.")
    from autotune.run.stages import execute

    opts = opts.replace(join=True, resume=False, devices=None, study_name=opts.study_name or "autotune")
    return execute(model, dataset, opts.replace(n_trials=_measured_here(opts)))


def _measured_here(opts: Options) -> int:
    """The trials the study's group for this machine's hardware measured: the budget that lets
    the search stage add none.

    Raises:
        ConfigError: no such study, no group for this hardware (or one with nothing measured),
            or trials still running.
    """
    import optuna

    from autotune.env import Env
    from autotune.search.parallel import check_devices
    from autotune.search.record import n_measured
    from autotune.search.storage import fail_stale, family, open_storage, redact

    name, where = opts.study_name, redact(opts.storage)
    storage = open_storage(opts.storage, opts.heartbeat_interval_s, opts.grace_period_s)
    members = family(storage, name)
    if not members:
        raise ConfigError(f"No study named {name!r} in {where}: give --study (study_name) as the workers had it.")
    hardware = Env.detect(check_devices(opts.device, None, opts.isolation)[0]).hardware_key()
    group = next((m for m in members if m.user_attrs.get("hardware") == hardware), None)
    study = None if group is None else optuna.load_study(study_name=group.study_name, storage=storage)
    if study is not None:
        fail_stale(study)  # a dead worker's trial, silent past the grace period, is not "running"
    if study is None or not n_measured(study):
        groups = "; ".join(str(m.user_attrs.get("hardware", "unknown")) for m in members)
        raise ConfigError(
            f"Study {name!r} in {where} has no trial measured on this machine's hardware ({hardware}), only on: "
            f"{groups}. Run collect on a machine like the workers': it re-measures their finalists."
        )
    running = [t.number for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING]
    if running:
        raise ConfigError(
            f"Study {name!r} in {where} still has {len(running)} running trial(s) ({', '.join(map(str, running))}): "
            "collect once the workers are done (autotune status shows them); a dead worker's trial counts as "
            f"running until it has been silent for the grace period ({opts.grace_period_s} s)."
        )
    return n_measured(study)
