"""A pytest plugin of the GPU check (:mod:`benchmarks.gpu.check`): one JSON line per event, written
the moment it happens, so the record survives a run that is killed.

    GPU_CHECK_LOG=events.jsonl python -m pytest -p benchmarks.gpu.check_log tests/test_gpu.py -m gpu

Events: ``collected`` (with ``--collect-only``: each selected test, its file relative to the
rootdir (absolute outside it), whether it is marked ``slow`` and its ``timeout`` mark),
``collect_error``, ``start`` (a test begins) and ``report`` (a phase that decides the test's
outcome: the call, or a setup or teardown that did not pass), with ``timed_out`` set where
pytest-timeout ended it. Without ``GPU_CHECK_LOG`` nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

ENV = "GPU_CHECK_LOG"
# What pytest-timeout's failure message says (its PYTEST_FAILURE_MESSAGE: "Timeout (>60s) from pytest-timeout.").
TIMEOUT_MARK = "from pytest-timeout"


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session: Any) -> None:
    if not session.config.option.collectonly:
        return
    for item in session.items:
        mark = item.get_closest_marker("timeout")
        _write(
            {
                "event": "collected",
                "nodeid": item.nodeid,
                "file": _file(item.path, session.config.rootpath),
                "slow": item.get_closest_marker("slow") is not None,
                "timeout_s": mark.args[0] if mark is not None and mark.args else None,
            }
        )


def _file(path: Any, rootdir: Any) -> str:
    """A test file's path relative to the rootdir, or absolute outside it."""
    relative = os.path.relpath(path, rootdir)
    return str(path) if relative.startswith("..") else relative


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _write({"event": "collect_error", "nodeid": report.nodeid, "message": _last_line(report.longreprtext)})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write({"event": "start", "nodeid": nodeid, "time": time.time()})


def pytest_runtest_logreport(report: Any) -> None:
    if report.when != "call" and report.passed:
        return  # a setup or teardown that passed decides nothing
    text = report.longreprtext if report.longrepr is not None else ""
    _write(
        {
            "event": "report",
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "timed_out": TIMEOUT_MARK in text,
            "duration_s": round(report.duration, 3),
            "message": _message(report, text),
        }
    )


def _message(report: Any, text: str) -> str:
    """One line: a skip's reason, or where a failure ended (the assertion or the error)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return _last_line(crash.message.splitlines()[0])
    return _last_line(text)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
