"""Where a worker writes a candidate's files (an ONNX graph, an OpenVINO IR, a TorchScript
trace), and who removes them.

Workers end killed (a restart, a fault, the run's close): nothing of a worker's own runs at its
end, so a folder it made for itself outlived it. Every worker of a run writes under the run's
scratch folder instead, one subfolder per process; the runner removes a worker's subfolder when
it has killed it, and the whole folder when it closes or its process exits. A process with no
runner above it (a trial run in-process, ``apply``) uses one folder that it removes at its exit.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

__all__ = ["SCRATCH_ENV", "Scratch", "candidate_dir", "run_file"]

SCRATCH_ENV = "AUTOTUNE_SCRATCH"  # the run's scratch folder, in its workers' environment

_OWN: tempfile.TemporaryDirectory[str] | None = None


def candidate_dir() -> Path:
    """A fresh folder for one candidate's files: under the run's scratch folder, in this
    process's subfolder, in a worker; else in a folder of this process's own."""
    global _OWN
    root = os.environ.get(SCRATCH_ENV)
    if root and Path(root).is_dir():
        mine = Path(root) / str(os.getpid())
        mine.mkdir(exist_ok=True)
        return Path(tempfile.mkdtemp(dir=mine))
    if _OWN is None:
        _OWN = tempfile.TemporaryDirectory(prefix="autotune-runtime-")
    return Path(tempfile.mkdtemp(dir=_OWN.name))


def run_file(name: str) -> Path | None:
    """A file of the whole run's, named ``name``, in its scratch folder (what one worker made
    that the run's later ones read); ``None`` in a process with no runner above it."""
    root = os.environ.get(SCRATCH_ENV)
    return Path(root) / name if root and Path(root).is_dir() else None


class Scratch:
    """A run's scratch folder, owned by its runner: :attr:`env` goes into each worker's
    environment, :meth:`drop` removes a killed worker's files, :meth:`close` all of them (also
    done when the runner is collected or its process exits)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="autotune-scratch-"))
        self.env = {SCRATCH_ENV: str(self.path)}
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def drop(self, pid: int) -> None:
        """Remove the files of the worker ``pid``, which has ended."""
        shutil.rmtree(self.path / str(pid), ignore_errors=True)

    def close(self) -> None:
        self._finalizer()
