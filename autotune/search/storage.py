"""The Optuna storage of a study that many workers share: heartbeats, one Optuna study per
hardware group, and storage URLs safe to print.

A study as the user names it (``--study NAME``) is a family of Optuna studies, one per hardware
group: ``NAME`` belongs to the first hardware that opened it, ``NAME@<slug>`` to each other
hardware. Each is stamped with study user attributes ``family``, ``hardware``, ``env`` and
``objectives``. Timings of different hardware never meet: each group has its own baseline, its
own sampler history and its own winner. Two facts force the split besides honesty: Optuna refuses
one parameter with different choices in one study (a GPU offers ``float16`` where a CPU does
not), and a sampler fed the throughputs of two machines would chase the faster machine instead
of the better configuration.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from autotune.errors import ConfigError

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_HEARTBEAT_S",
    "check_heartbeat",
    "fail_stale",
    "family",
    "grace_period_of",
    "owner_attrs",
    "hardware_slug",
    "heartbeat",
    "open_group",
    "open_storage",
    "redact",
    "storage_of",
]

# A worker records a heartbeat this often while it holds a trial; the beat comes from a thread
# of the parent, so a trial that runs for an hour in its worker process keeps beating. Only a
# dead or frozen parent (or a database out of reach) falls silent.
DEFAULT_HEARTBEAT_S = 30
# Silence after which any worker may declare a trial dead, fail it and queue its retry: six
# missed beats, so a database hiccup or a parent busy for a minute is not mistaken for a death.
DEFAULT_GRACE_S = 180
# How long a worker waits for the worker that created a study to stamp it with its hardware.
_STAMP_WAIT_S = 10.0


def redact(url: str) -> str:
    """The storage URL with its password replaced by ``***``, for files and messages.

    Example:
        >>> redact("postgresql://tuner:secret@db:5432/studies")
        'postgresql://tuner:***@db:5432/studies'
    """
    url = re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)  # a password may hold '/'
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)


def check_heartbeat(heartbeat_interval_s: Any, grace_period_s: Any) -> tuple[int, int]:
    """Both settings as whole seconds (what Optuna stores), or :class:`ConfigError`."""
    for name, value in (("heartbeat_interval_s", heartbeat_interval_s), ("grace_period_s", grace_period_s)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"`{name}` must be a positive whole number of seconds, but got {value!r}.")
    if grace_period_s <= heartbeat_interval_s:
        raise ConfigError(
            f"`grace_period_s` ({grace_period_s}) must be longer than `heartbeat_interval_s` "
            f"({heartbeat_interval_s}), or live workers would be declared dead between two beats; "
            "make it a few intervals."
        )
    return heartbeat_interval_s, grace_period_s


def _where(url: str) -> str:
    found = re.search(r"://(?:[^@/]*@)?([^/?]*)", url)
    return found.group(1) if found and found.group(1) else url.split("://", 1)[0]


def open_storage(
    url: str, heartbeat_interval_s: int = DEFAULT_HEARTBEAT_S, grace_period_s: int = DEFAULT_GRACE_S
) -> Any:
    """Open an Optuna RDB storage (SQLite, PostgreSQL, MySQL) with heartbeats and one retry.

    A trial whose worker stopped beating for ``grace_period_s`` is failed by the next worker
    that looks, and Optuna's ``RetryHeartbeatStaleTrialCallback`` queues its configuration once
    more, with ``failed_trial`` in its system attributes.

    Raises:
        ConfigError: the URL is malformed, its driver is missing, or the database is out of reach.
    """
    import optuna
    import sqlalchemy.exc

    heartbeat_interval_s, grace_period_s = check_heartbeat(heartbeat_interval_s, grace_period_s)
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(
            f"`storage` must be a database URL such as sqlite:///study.db or "
            f"postgresql://USER@HOST/DB, but got {url!r}."
        )
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Several processes share the file: wait for its lock instead of failing at once.
        engine_kwargs["connect_args"] = {"timeout": 60}
    elif url.startswith("postgresql"):
        # A connection the server or a firewall dropped during a long trial is replaced, not an error.
        engine_kwargs["pool_pre_ping"] = True
        engine_kwargs["connect_args"] = {"connect_timeout": 10}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            storage = _create_rdb(url, engine_kwargs, heartbeat_interval_s, grace_period_s)
        except ImportError as exc:
            fix = (
                'pip install "torch-autotune[postgres]"'
                if url.startswith("postgresql")
                else "install the driver it names"
            )
            cause = exc.__cause__ or exc
            raise ConfigError(f"Storage {redact(url)} needs a database driver ({cause}): {fix}.") from None
        except sqlalchemy.exc.ArgumentError as exc:
            hint = " Write postgresql://, not postgres://." if url.startswith("postgres:") else ""
            raise ConfigError(f"`storage` {redact(url)} is not a usable database URL: {exc}.{hint}") from None
        except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
            cause = exc.__cause__ if isinstance(exc, optuna.exceptions.StorageInternalError) else exc
            reason = str(getattr(cause, "orig", None) or cause or exc).strip().splitlines()[0]
            raise ConfigError(
                f"Cannot open the storage at {_where(url)} ({redact(url)}): {reason}. Check that the server "
                "runs and is reachable from here, and the URL's user, password and database."
            ) from None
    if storage.engine.name == "sqlite":
        _serialize_sqlite(storage.engine)
    return storage


def _create_rdb(url: str, engine_kwargs: dict[str, Any], heartbeat_interval_s: int, grace_period_s: int) -> Any:
    """``RDBStorage(url, ...)``, retried when workers starting together race to create its tables.

    Optuna creates the tables and stamps the schema version when a storage first opens a
    database; two processes doing it at once make one fail on a duplicate. The loser's retry
    finds everything in place.
    """
    import optuna
    import sqlalchemy.exc

    attempt = 0
    while True:
        try:
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=heartbeat_interval_s,
                grace_period=grace_period_s,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
            )
        except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
            text = f"{exc} {exc.__cause__}".lower()
            race = isinstance(exc.__cause__ or exc, sqlalchemy.exc.IntegrityError) or any(
                word in text for word in ("unique constraint", "duplicate", "already exists")
            )
            if not race or attempt == 5:
                raise
            time.sleep(0.1 * 2**attempt)
            attempt += 1


def _serialize_sqlite(engine: Any) -> None:
    """Make every SQLite transaction ``BEGIN IMMEDIATE``.

    Python's sqlite3 begins a transaction only at its first write, so two processes can both
    read a WAITING trial and both mark it RUNNING: Optuna's ``SELECT ... FOR UPDATE`` means
    nothing to SQLite. Taking the write lock at BEGIN makes each Optuna call atomic, as it is on
    PostgreSQL (the recipe of SQLAlchemy's pysqlite documentation).
    """
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners would keep the old behaviour


def storage_of(study: Any) -> Any:
    """The storage behind an ``optuna.Study``.

    Optuna keeps no public handle to it; its own ``optimize`` loop uses this attribute for the
    same purpose (heartbeats).
    """
    return study._storage


def grace_period_of(study: Any) -> float | None:
    """Seconds of heartbeat silence after which a trial is taken for dead, or ``None``."""
    return getattr(storage_of(study), "grace_period", None)


def owner_attrs() -> dict[str, Any]:
    """Who runs a trial: this host and process (with its start time, so a reused pid is not
    mistaken for it). Stamped on every trial, so a dead process's trial can be told apart."""
    import os
    import socket

    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": psutil.Process().create_time()}


def _owner_dead(attrs: Mapping[str, Any]) -> bool:
    """Whether a trial's owner process ran on this host and is gone."""
    import socket

    import psutil

    # The owner's stamp is written one attribute at a time: a trial read between its pid and its
    # pid's start time is being claimed right now (two workers failed a live baseline that way).
    if attrs.get("host") != socket.gethostname() or attrs.get("pid") is None or attrs.get("pid_started") is None:
        return False
    try:
        return psutil.Process(attrs["pid"]).create_time() != attrs.get("pid_started")
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def fail_dead_local(study: Any) -> list[int]:
    """Fail the RUNNING trials whose owner process on this host is gone (a run killed with
    SIGKILL, say), at once rather than after the grace period, and queue each one's
    configuration again. Returns their numbers."""
    import optuna
    from optuna.trial import TrialState

    storage = storage_of(study)
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not _owner_dead(t.user_attrs):
            continue
        with contextlib.suppress(Exception):
            storage.set_trial_user_attr(t._trial_id, "status", "interrupted")
            storage.set_trial_user_attr(
                t._trial_id, "reason", f"its process (pid {t.user_attrs['pid']}) ended while it ran"
            )
            if storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                failed.append(t.number)
                # The retry Optuna's heartbeat callback would queue after the grace period, now.
                study.add_trial(
                    optuna.trial.create_trial(
                        state=TrialState.WAITING,
                        params=t.params,
                        distributions=t.distributions,
                        user_attrs={"baseline": True} if t.user_attrs.get("baseline") else {},
                        system_attrs={"failed_trial": t.number, "retry_history": [t.number]},
                    )
                )
    return failed


def fail_stale(study: Any) -> None:
    """Fail the study's trials whose worker stopped beating (or, on this host, whose process is
    gone), and queue their retries.

    A database hiccup here is ignored: the next look tries again.
    """
    import optuna

    with contextlib.suppress(Exception):
        fail_dead_local(study)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        with contextlib.suppress(Exception):
            optuna.storages.fail_stale_trials(study)


@contextlib.contextmanager
def heartbeat(study: Any, trial: Any) -> Iterator[None]:
    """Beat for ``trial`` from a thread of this process until the block ends.

    Optuna's ``Study.optimize`` does this itself; autotune asks and tells trials one by one,
    so it beats on its own. The first beat is recorded before the block starts: a trial with
    no beat at all is never declared dead. A failed beat (the database out of reach for a
    moment) is retried at the next interval instead of ending the thread.
    """
    storage = storage_of(study)
    interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
    if interval is None:
        yield
        return
    trial_id = trial._trial_id  # Optuna's own heartbeat thread is keyed by this id too
    with contextlib.suppress(Exception):  # the thread beats again within an interval
        storage.record_heartbeat(trial_id)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial_id)

    thread = threading.Thread(target=beat, name=f"autotune-heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def hardware_slug(hardware: str) -> str:
    """A file- and name-safe form of a hardware key, unique per key.

    Example:
        >>> hardware_slug("NVIDIA A100-SXM4-80GB (sm80) x8, driver 550.54.15")[:32]
        'nvidia-a100-sxm4-80gb-sm80-x8-dr'
    """
    words = re.sub(r"[^a-z0-9]+", "-", hardware.lower()).strip("-")[:60].rstrip("-")
    return f"{words}-{hashlib.sha1(hardware.encode()).hexdigest()[:6]}"


def family(storage: Any, name: str) -> list[Any]:
    """The Optuna studies (``FrozenStudy``) of the study ``name``: one per hardware group."""
    return [s for s in storage.get_all_studies() if s.study_name == name or s.user_attrs.get("family") == name]


def _stamp(storage: Any, study_id: int, name: str, hardware: str, attrs: Mapping[str, Any]) -> None:
    for key, value in {**attrs, "family": name, "hardware": hardware}.items():
        storage.set_study_user_attr(study_id, key, value)


def open_group(
    storage: Any, name: str, hardware: str, directions: Sequence[Any], attrs: Mapping[str, Any]
) -> tuple[str, bool]:
    """Find or create the Optuna study of ``hardware`` in the family ``name``.

    Several workers may call this at once; ``create_new_study`` is the one atomic step (a
    second creator of the same name gets ``DuplicatedStudyError`` and looks again). A study
    without a hardware stamp is either being created this instant (wait for the stamp) or was
    written by an earlier autotune (the first worker to look adopts it).

    Returns:
        ``(optuna study name, created)``.
    """
    import optuna

    deadline = time.monotonic() + _STAMP_WAIT_S
    while True:
        members = family(storage, name)
        for study in members:
            if study.user_attrs.get("hardware") == hardware:
                return study.study_name, False
        home = next((s for s in members if s.study_name == name), None)
        if home is not None and "hardware" not in home.user_attrs:
            study_id = storage.get_study_id_from_name(name)
            if storage.get_n_trials(study_id) == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            _stamp(storage, study_id, name, hardware, attrs)
            return name, False
        target = name if home is None else f"{name}@{hardware_slug(hardware)}"
        try:
            study_id = storage.create_new_study(list(directions), target)
        except optuna.exceptions.DuplicatedStudyError:
            if time.monotonic() > deadline + _STAMP_WAIT_S:
                raise ConfigError(
                    f"Study {target!r} exists but was never stamped with its hardware; delete it "
                    "(optuna delete-study) or choose another study name."
                ) from None
            time.sleep(0.1)  # its creator is about to stamp it
            continue
        _stamp(storage, study_id, name, hardware, attrs)
        return target, True


def withdraw_twins(study: Any) -> None:
    """Of queued trials with the same configuration (two workers queued it at the same moment),
    keep the oldest: the others are failed while still waiting, marked ``withdrawn``."""
    import contextlib

    from optuna.trial import TrialState

    storage, seen = study._storage, set()
    for t in study.get_trials(deepcopy=False):
        key = t.user_attrs.get("queued_key")
        if key is None:
            continue
        if key in seen and t.state == TrialState.WAITING:
            # Taken as a worker's ask takes a queued trial: atomically, and only if still waiting
            # (another worker may have asked for it, or withdrawn it, first).
            with contextlib.suppress(Exception):
                if storage.set_trial_state_values(t._trial_id, TrialState.RUNNING):
                    storage.set_trial_user_attr(t._trial_id, "withdrawn", True)
                    storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        seen.add(key)
