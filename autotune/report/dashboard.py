"""``autotune dashboard OUT_DIR``: a run's study in optuna-dashboard (the ``dashboard`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.report.data import storage_of

__all__ = ["dashboard_storage", "run_dashboard"]

_MISSING = (
    '`autotune dashboard` needs optuna-dashboard, which is not installed: pip install "torch-autotune[dashboard]"'
)


def dashboard_storage(out_dir: str | Path) -> str:
    """The storage URL of the run in ``out_dir``: the one ``best_config.json`` names, else
    ``OUT_DIR/study.db`` (see :func:`autotune.report.data.storage_of`)."""
    return storage_of(out_dir)[0]


def _import_dashboard() -> Any:
    try:
        import optuna_dashboard
    except ImportError:
        raise ConfigError(_MISSING) from None
    return optuna_dashboard


def resolve_dashboard(out_dir: str | Path, storage: str | None = None) -> str:
    """The storage URL the dashboard of ``out_dir`` will serve, once it is known that it can.

    Raises:
        ConfigError: optuna-dashboard is not installed, or the recorded storage URL had its
            password removed and ``storage`` was not given.
        InputError: ``out_dir`` holds neither ``best_config.json`` nor ``study.db``.
    """
    _import_dashboard()
    url = storage or dashboard_storage(out_dir)
    if ":***@" in url:
        raise ConfigError(
            f"The storage recorded for {out_dir} has no password ({url}); give the full URL with --storage URL."
        )
    return url


def run_dashboard(
    out_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8080, storage: str | None = None
) -> None:
    """Serve optuna-dashboard on the run's storage until interrupted (blocks).

    Args:
        out_dir: The run's output directory.
        host: Address to listen on.
        port: Port to listen on.
        storage: A storage URL to use instead of the recorded one (which has no password).

    Raises:
        ConfigError, InputError: see :func:`resolve_dashboard`.
    """
    url = resolve_dashboard(out_dir, storage)
    _import_dashboard().run_server(url, host=host, port=port)
