"""The options of one run: every keyword of :func:`autotune.optimize`, validated once, frozen.

:func:`autotune.optimize` builds an :class:`Options` from its keywords; ``autotune run`` builds
the same object from cfg.py and its flags (:meth:`Options.from_cfg`). Every stage of the run
reads it, and no stage re-checks what it holds.

Example:
    >>> Options(n_trials=5).n_trials
    5
    >>> Options(max_metric_drop=1.5)
    Traceback (most recent call last):
    ...
    autotune.errors.ConfigError: `max_metric_drop` must be in [0, 1], but got 1.5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = ["CFG_OPTIONS", "Options", "DEFAULT_MEASURE"]

DEFAULT_MEASURE = {"n_windows": 5, "window_s": 0.4, "warmup_batches": 3}
# What cfg.py may define at its top level besides model, dataset and options.
CFG_OPTIONS = (
    "metric",
    "max_metric_drop",
    "space",
    "loss_fn",
    "train_dataset",
    "test_dataset",
    "mode",
    "optimizer",
    "collate_fn",
)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"`{name}` must be a positive integer, but got {value!r}.")


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(value: Any, name: str = "budget") -> float:
    """Seconds from a number of seconds or a duration such as ``"90s"``, ``"5m"``, ``"1h30m"``.

    Raises:
        ConfigError: not a positive duration.

    Example:
        >>> parse_duration("5m"), parse_duration("1h30m"), parse_duration(45), parse_duration("2.5m")
        (300.0, 5400.0, 45.0, 150.0)
    """
    import re

    if _seconds(value):
        return float(value)
    text = str(value).strip().lower().replace(" ", "")
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text)
    if isinstance(value, str) and text and parts is not None:
        seconds = sum(float(v) * u for v, u in zip(parts.groups(), _UNITS.values(), strict=True) if v)
        if seconds > 0:
            return seconds
    raise ConfigError(
        f"`{name}` must be a positive duration: seconds (300) or with units (90s, 5m, 1h30m), but got {value!r}."
    )


# A run given none of n_trials, timeout and budget measures this many trials within this many
# seconds, whichever ends first: a first try's bound (16 trials of a real text model took 217 s on
# 2 cores; a ResNet-50 on a GPU about as long), said in the run's first lines.
DEFAULT_N_TRIALS = 30
DEFAULT_BUDGET_S = 600.0


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option of a run; see :func:`autotune.optimize` for what each means."""

    mode: str = "inference"
    space: str | Path | Mapping[str, Any] = "default"
    metric: Callable[[Any, Any], float] | None = None
    max_metric_drop: float = 0.01
    objectives: Sequence[str] | str | None = None
    n_trials: int | None = None
    timeout: float | None = None
    device: str = "auto"
    out_dir: str | Path = "autotune-out"
    storage: str | None = None
    study_name: str | None = None
    resume: bool = False
    join: bool = False
    devices: Sequence[int | str] | str | None = None
    heartbeat_interval_s: int = 30
    grace_period_s: int = 180
    fix: Mapping[str, Any] | None = None
    seed: int = 0
    baseline_batch_size: int | None = None
    trial_timeout: float | None = None
    isolation: str = "subprocess"
    n_val: int = 512
    measure: Mapping[str, Any] | None = None
    n_verify_pairs: int = 4
    n_finalists: int = 3
    select: Any = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    train_dataset: Any = None
    prune_ignore: Sequence[str] = ()
    test_dataset: Any = None
    export: Sequence[str] | str | None = None
    sampler: Any = None
    strategy: str = "staged"
    optimizer: Any = None
    effective_batch_size: int | None = None
    allow_batch_change: bool = False
    loss_tolerance: float = 0.05
    n_train_steps: int = 20
    progress: Callable[[dict[str, Any], int, int], None] | None = None
    output_kind: Any = "auto"
    collate_fn: Callable[[list[Any]], Any] | None = None
    pad_values: Mapping[str, int] | None = None
    profile: bool = True
    repeated_passes: bool = False
    budget: float | str | None = None

    def __post_init__(self) -> None:
        if self.n_trials is None:  # nothing bounds the run: the default trials, within the default budget
            object.__setattr__(self, "n_trials", DEFAULT_N_TRIALS)
            if self.timeout is None and self.budget is None:
                object.__setattr__(self, "budget", DEFAULT_BUDGET_S)
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_duration(self.budget))
        self._check_numbers()
        self._check_choices()
        from autotune.search.select import check_select
        from autotune.search.storage import check_heartbeat
        from autotune.trial.fidelity import check_output_kind

        check_select(self.select)
        check_output_kind(self.output_kind)
        check_heartbeat(self.heartbeat_interval_s, self.grace_period_s)
        if self.train:
            from autotune.trial.train_setup import check_training

            check_training(
                self.loss_fn,
                self.optimizer,
                self.test_dataset,
                self.export,
                self.loss_tolerance,
                self.n_train_steps,
                self.train_dataset,
                self.effective_batch_size,
                self.allow_batch_change,
                self.baseline_batch_size,  # None: a DataLoader's, checked once it is read
            )
        object.__setattr__(self, "export", self._formats())
        self.timing()  # a bad `measure` fails here, before anything runs

    def _check_numbers(self) -> None:
        _positive_int("n_trials", self.n_trials)
        _positive_int("n_val", self.n_val)
        if self.baseline_batch_size is not None:
            _positive_int("baseline_batch_size", self.baseline_batch_size)
        if self.timeout is not None and not _seconds(self.timeout):
            raise ConfigError(f"`timeout` must be a positive number of seconds or None, but got {self.timeout!r}.")
        if self.trial_timeout is not None and not _seconds(self.trial_timeout):
            raise ConfigError(
                f"`trial_timeout` must be a positive number of seconds, or None for the adaptive limit, but got "
                f"{self.trial_timeout!r}."
            )
        drop = self.max_metric_drop
        if not isinstance(drop, (int, float)) or isinstance(drop, bool) or not 0 <= drop <= 1:
            raise ConfigError(f"`max_metric_drop` must be in [0, 1], but got {drop!r}.")

    def _check_choices(self) -> None:
        from autotune.search.strategy import check_strategy

        check_strategy(self.strategy)
        if self.isolation not in ("subprocess", "inprocess"):
            raise ConfigError(f"`isolation` must be 'subprocess' or 'inprocess', but got {self.isolation!r}.")
        if self.join and self.storage is None:
            # Each worker would open its own sqlite:///<out_dir>/study.db and search alone.
            raise ConfigError(
                "`join=True` (CLI: --join) shares a study through a database every worker reaches, but no `storage` "
                "was given, so each worker would search alone in its own out_dir's study.db: give every worker the "
                "same storage=URL (CLI: --storage postgresql://...), or use devices=[...] (--devices) on one machine."
            )
        if self.mode not in ("inference", "train"):
            raise ConfigError(f"`mode` must be 'inference' or 'train', but got {self.mode!r}.")
        if self.pad_values is not None and not (
            isinstance(self.pad_values, Mapping)
            and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in self.pad_values.items()
            )
        ):
            raise ConfigError(
                f"`pad_values` must map input names to integer pad ids, like {{'input_ids': 0}}, but got {self.pad_values!r}."
            )
        if not isinstance(self.profile, bool):
            raise ConfigError(f"`profile` must be True or False, but got {self.profile!r}.")
        if self.metric is not None and not callable(self.metric):
            raise ConfigError(
                f"`metric` must be a function metric(outputs, batch) -> float, but got {type(self.metric).__name__}."
            )

    def _formats(self) -> tuple[str, ...]:
        export = self.export if self.export is not None else (() if self.train else ("onnx", "torchscript"))
        formats = (export,) if isinstance(export, str) else tuple(export or ())
        formats = tuple(f for f in formats if f != "none")
        from autotune.runtimes.base import requestable_formats

        known = requestable_formats()
        for fmt in formats:
            if fmt not in known:
                raise ConfigError(f"No export format named {fmt!r}. Known: {', '.join(known)} (or none).")
        return formats

    @property
    def train(self) -> bool:
        """Whether the run tunes the training step."""
        return self.mode == "train"

    def timing(self) -> Any:
        """The :class:`~autotune.trial.measure.MeasureSettings` of every timed window."""
        from autotune.trial.measure import MeasureSettings

        # Under a time limit a noisy trial is measured again once, not twice: on a noisy 2-core
        # machine, three measurements of the baseline and of OpenVINO's float build took 55 s of
        # a 3-minute budget, and OpenVINO bf16 (1.5x the best) was refused for 2 s.
        again = {"n_remeasure": 1} if self.limit_s is not None else {}
        try:
            return MeasureSettings(**{**DEFAULT_MEASURE, **again, **dict(self.measure or {})})
        except TypeError as exc:
            raise ConfigError(
                "`measure` takes n_windows, window_s, warmup_batches, max_cov, max_others_cpu, n_remeasure and "
                f"stop_share: {exc}."
            ) from None

    @property
    def limit_s(self) -> float | None:
        """Seconds the whole run may take: the ``budget`` it plans to end in, or the ``timeout``
        (the hard stop), whichever is shorter; ``None`` without either."""
        limits = [t for t in (self.timeout, self.budget) if t is not None]
        return min(limits) if limits else None

    @property
    def margin_s(self) -> float:
        """Seconds the export may run past :attr:`limit_s`: 5% of a budget (a budget run ends
        within 10% of it, its result files written), else :func:`overrun_margin` of the timeout."""
        if self.budget is not None and self.budget == self.limit_s:
            return 0.05 * self.budget
        from autotune.run.finish import overrun_margin

        return overrun_margin(self.limit_s or 0.0)

    def plan_args(self) -> dict[str, Any]:
        """The keywords of :func:`autotune.plan` these options set."""
        names = ("space", "fix", "device", "baseline_batch_size", "objectives", "loss_fn", "mode", "collate_fn")
        names += ("pad_values", "n_val", "train_dataset", "repeated_passes")
        return {
            **{n: getattr(self, n) for n in names},
            "effective_batch_size": self.effective_batch_size,
            "allow_batch_change": self.allow_batch_change,
        }

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> list[str]:
        """Every option's name."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any], flags: Mapping[str, Any], where: str = "cfg.py") -> Options:
        """The options of ``autotune run``: cfg.py's ``options`` dict, then its top-level
        definitions (``metric``, ``space``, ...), then the command line's ``flags`` (those not
        ``None``), each overriding the one before.

        Raises:
            ConfigError: an unknown key in ``options``, naming the known ones.
        """
        options = dict(cfg.get("options", {}))
        known = set(cls.names())
        for key in options:
            if key not in known:
                raise ConfigError(f"Unknown option {key!r} in {where}'s options. Known: {', '.join(sorted(known))}.")
        options.update({k: cfg[k] for k in CFG_OPTIONS if k in cfg})
        for key, value in flags.items():
            if value is None:
                continue
            options[key] = {**(options.get("fix") or {}), **value} if key == "fix" else value
        return cls(**options)
