"""A process that ends when its parent does: trial workers, and the ranks of a distributed trial."""

from __future__ import annotations

__all__ = ["watch_parent"]


def watch_parent(parent: int | None = None, interval_s: float = 0.5, alive: bool = False) -> None:
    """End this worker, and the loader processes it started, once its parent is gone.

    The worker runs in a session of its own (so Ctrl-C reaches only the parent), so nothing
    else stops it when the parent is killed: a test killed at its timeout left its worker
    holding the GPU. A parent that dies hands its children to another process, which changes
    ``os.getppid()``; a daemon thread looks every ``interval_s``.
    """
    import os
    import shutil
    import signal
    import threading
    import time

    from autotune.export.scratch import SCRATCH_ENV

    parent = os.getppid() if parent is None else parent  # given: a parent gone before now counts too

    born = _started(parent) if alive else None

    def there() -> bool:
        if not alive:
            return os.getppid() == parent
        # ``alive``: not this process's parent, watched while it runs: gone, a zombie no one
        # reaped yet, or its number taken by another process since, it has ended.
        return born is not None and _started(parent) == born

    def watch() -> None:
        while there():
            time.sleep(interval_s)
        if os.environ.get(SCRATCH_ENV):  # the run's candidate files, which its runner died before removing
            shutil.rmtree(os.environ[SCRATCH_ENV], ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)  # this worker and its loader workers

    threading.Thread(target=watch, name="autotune-parent-watch", daemon=True).start()


def _started(pid: int) -> float | None:
    """When process ``pid`` started, or ``None`` where it has ended (a zombie too)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.Error:
        return None
