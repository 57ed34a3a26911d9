"""The GPU check: every test file with ``gpu`` tests, then the GPU headline benchmark, on one CUDA
GPU within a budget (default 8 minutes), for a short lease on a GPU machine.

    python -m benchmarks.gpu.check [--out gpu-check-logs] [--budget-s 480] [--bench-s S | --no-bench] [--workloads W,...]
    python -m benchmarks.gpu.check --rerun gpu-check-logs/summary.json --out logs2 --no-bench

The ``gpu`` tests are collected first (``pytest -m gpu --collect-only``), then each file runs in a
pytest process of its own, cheapest first (a ``slow`` test weighs as five), with a time limit per
test (pytest-timeout's ``--timeout``; a test's own ``timeout`` mark wins) and one for the whole
file, after which its processes are killed: a hang costs only its own file. Each file's limit is
twice its share of the time left for the tests (:func:`file_share`), so what a quick file leaves
goes to those after it.
The benchmark (``python -m benchmarks.gpu``, on ``--workloads``: ResNet-50 on float images unless told) gets
what is left then, ``--bench-s`` at least. ``--rerun`` takes an earlier check's ``summary.json`` and
runs only the tests that failed, timed out or did not run there: a second short lease finishes
what the first left (the whole-study tests take over a minute each on an H100 machine).

Everything is written under ``--out`` as it happens, so it survives a killed run: ``check.log``
(this command's own lines), ``collected.json``, ``tests/<file>.log`` (pytest's output) and
``tests/<file>.jsonl`` (each test's start and outcome, :mod:`benchmarks.gpu.check_log`),
``bench.log`` with the benchmark's tables in ``bench/``, and ``summary.md``/``summary.json``
(counts per file: passed, failed, skipped, timed out, not run), rewritten after each file.
Exit status: 0 when every test passed or skipped and the benchmark finished, 1 otherwise,
2 without CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "benchmarks.gpu.check_log"
OUTCOMES = ("passed", "failed", "skipped", "timed_out", "not_run")
SLOW_WEIGHT = 5  # a slow test (compiles, whole studies) against a plain one, for the files' shares
BENCH_SHARE = 0.45  # of the budget kept for the benchmark unless --bench-s says otherwise
MIN_FILE_S = 30.0  # a file given less is not started (pytest, torch and CUDA take ~10 s to start)
OVERBOOK = 2.0  # a file's limit against its even share of the time left: limits bound hangs, few files reach them
MIN_TEST_S = 60.0  # the per-test limit is at least this (or the file's whole limit, if less)
MIN_BENCH_S = 90.0
BENCH_MARGIN_S = 20.0  # the benchmark is asked to finish this much before it would be killed
KILL_GRACE_S = 5.0


def log_line(out: Path, text: str) -> None:
    """Print ``text`` and append it to ``out/check.log`` at once."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp}] {text}", flush=True)
    with open(out / "check.log", "a") as f:
        f.write(f"[{stamp}] {text}\n")


def read_events(path: Path) -> list[dict[str, Any]]:
    """The plugin's events in ``path`` (none if it is missing); a line cut by a kill is left out."""
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _pytest(args: list[str], events: Path, log: Path, timeout_s: float | None, cwd: Path) -> tuple[int | None, float]:
    """Run ``python -u -m pytest ARGS`` in ``cwd``, its output to ``log`` and the
    plugin's events to ``events``; past ``timeout_s`` kill it and every process it started
    (trial workers run in sessions of their own). Returns (exit code or ``None`` when killed, seconds)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # the plugin's package
    env = {**os.environ, "GPU_CHECK_LOG": str(events.resolve()), "PYTHONPATH": path}
    # One rootdir for the collection and every file's run: the test ids must be the same in both.
    cmd = [sys.executable, "-u", "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", f"--rootdir={cwd}", *args]
    started = time.monotonic()
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            _kill_family(proc.pid)
            proc.wait(KILL_GRACE_S)
    return code, time.monotonic() - started


def collect(
    out: Path, paths: tuple[str, ...] = ("tests",), cwd: Path = ROOT
) -> tuple[dict[str, list[dict[str, Any]]], list[dict]]:
    """The ``gpu`` tests under ``paths`` (relative to ``cwd``), by file, as pytest selects them
    (``-m gpu``), with the modules that failed to import (their tests are unknown). Written to
    ``out/collected.json``."""
    events_path = out / "collect.jsonl"
    events_path.unlink(missing_ok=True)
    args = ["--collect-only", "-q", "-m", "gpu", "--continue-on-collection-errors", *paths]
    _pytest(args, events_path, out / "collect.log", 300, cwd)
    events = read_events(events_path)
    files: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["event"] == "collected":
            files.setdefault(e["file"], []).append({k: e[k] for k in ("nodeid", "slow", "timeout_s")})
    errors = [{k: e[k] for k in ("nodeid", "message")} for e in events if e["event"] == "collect_error"]
    (out / "collected.json").write_text(json.dumps({"files": files, "errors": errors}, indent=2) + "\n")
    return files, errors


def finished(summary: Path) -> set[str]:
    """The tests that passed or skipped in the earlier check whose ``summary.json`` is ``summary``."""
    doc = json.loads(summary.read_text())
    return {t["nodeid"] for rec in doc["files"] for t in rec["tests"] if t["outcome"] in ("passed", "skipped")}


def unfinished(files: dict[str, list[dict[str, Any]]], done: set[str]) -> dict[str, list[dict[str, Any]]]:
    """``files`` without the tests in ``done`` (:func:`finished`): those that failed, timed out or
    did not run there, and those it did not know (they never ran)."""
    cut = {path: [t for t in tests if t["nodeid"] not in done] for path, tests in files.items()}
    return {path: tests for path, tests in cut.items() if tests}


def weight(tests: list[dict[str, Any]]) -> int:
    """What a file is expected to cost, in plain tests: a slow one counts :data:`SLOW_WEIGHT`."""
    return sum(SLOW_WEIGHT if t["slow"] else 1 for t in tests)


def order(files: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Files cheapest first (by :func:`weight`, then name)."""
    return sorted(files, key=lambda f: (weight(files[f]), f))


def file_share(left_s: float, file_weight: int, remaining_weight: int) -> float:
    """A file's time limit: :data:`OVERBOOK` times its share by :func:`weight` of the time left
    for the tests (most files end well under their limit, which only bounds a hang), at least
    :data:`MIN_FILE_S`, never past what is left."""
    return min(left_s, max(MIN_FILE_S, OVERBOOK * left_s * file_weight / max(remaining_weight, 1)))


def file_limits(share_s: float, n_tests: int) -> tuple[float, float]:
    """(the whole file's limit, the per-test limit) for a file given ``share_s`` seconds: a test
    may take twice its even share of the file, :data:`MIN_TEST_S` at least, never more than the file."""
    per_test = max(MIN_TEST_S, 2 * share_s / max(n_tests, 1))
    return share_s, min(per_test, share_s)


def outcomes(tests: list[dict[str, Any]], events: list[dict[str, Any]], killed: bool, code: int | None) -> list[dict]:
    """Each collected test's outcome from the file's events: ``passed``, ``failed``, ``skipped``,
    ``timed_out`` (by pytest-timeout, or running when the file's limit killed it) or ``not_run``,
    with a one-line ``message``. A test running when the process died on its own failed."""
    started = {e["nodeid"] for e in events if e["event"] == "start"}
    reports: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["event"] == "report":
            reports.setdefault(e["nodeid"], []).append(e)
    rows = []
    for test in tests:
        nodeid, got = test["nodeid"], reports.get(test["nodeid"], [])
        failed = [r for r in got if r["outcome"] == "failed"]
        if any(r["timed_out"] for r in got):
            row = {"outcome": "timed_out", "message": next(r["message"] for r in got if r["timed_out"])}
        elif failed:
            row = {"outcome": "failed", "message": failed[0]["message"]}
        elif any(r["outcome"] == "skipped" for r in got):
            row = {"outcome": "skipped", "message": next(r["message"] for r in got if r["outcome"] == "skipped")}
        elif any(r["outcome"] == "passed" for r in got):
            row = {"outcome": "passed", "message": ""}
        elif nodeid in started and killed:
            row = {"outcome": "timed_out", "message": "running when the file's time limit killed it"}
        elif nodeid in started:
            row = {"outcome": "failed", "message": f"the pytest process died during this test (exit code {code})"}
        else:
            row = {"outcome": "not_run", "message": ""}
        rows.append({"nodeid": nodeid, **row})
    return rows


def run_file(
    path: str, tests: list[dict[str, Any]], share_s: float, out: Path, cwd: Path = ROOT, per_test_s: float | None = None
) -> dict[str, Any]:
    """Run one file's ``gpu`` tests within ``share_s`` and return its record (:func:`outcomes`);
    ``per_test_s`` overrides :func:`file_limits`' per-test limit."""
    slug = path.removeprefix("tests/").removesuffix(".py").strip("/").replace("/", "__")
    events_path, log = out / "tests" / f"{slug}.jsonl", out / "tests" / f"{slug}.log"
    events_path.unlink(missing_ok=True)
    limit_s, per_test = file_limits(share_s, len(tests))
    per_test_s = per_test if per_test_s is None else per_test_s
    args = [f"{path}::{t['nodeid'].split('::', 1)[1]}" for t in tests] + ["-m", "gpu", "-v"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        args += [f"--timeout={per_test_s:.0f}", "--timeout-method=signal"]
    code, wall_s = _pytest(args, events_path, log, limit_s, cwd)
    rows = outcomes(tests, read_events(events_path), code is None, code)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in OUTCOMES}
    return {"file": path, "limit_s": round(limit_s), "per_test_s": round(per_test_s), "wall_s": round(wall_s, 1),
            "exit_code": code, "killed": code is None, "counts": counts, "tests": rows}  # fmt: skip


def not_started(path: str, tests: list[dict[str, Any]], why: str) -> dict[str, Any]:
    """The record of a file the budget left no time for."""
    rows = [{"nodeid": t["nodeid"], "outcome": "not_run", "message": why} for t in tests]
    counts = {k: len(rows) if k == "not_run" else 0 for k in OUTCOMES}
    return {"file": path, "limit_s": 0, "per_test_s": 0, "wall_s": 0.0, "exit_code": None, "killed": False,
            "counts": counts, "tests": rows, "skipped_why": why}  # fmt: skip


def summary_text(doc: dict[str, Any]) -> str:
    """The summary as Markdown: one row of counts per file, then every test that did not pass
    or skip with its message, the collection errors and the benchmark's line."""
    head = "| file | tests | passed | failed | skipped | timed out | not run | seconds (limit) |"
    lines = [f"# GPU check, {doc['date']}", "", doc["machine"], "", head, "|" + "---|" * 8]
    totals = dict.fromkeys(OUTCOMES, 0)
    for rec in doc["files"]:
        c = rec["counts"]
        for k in OUTCOMES:
            totals[k] += c[k]
        wall = f"{rec['wall_s']:.0f} ({rec['limit_s']}{', killed' if rec['killed'] else ''})"
        cells = [rec["file"], sum(c.values()), *(c[k] for k in OUTCOMES), wall]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    cells = ["all", sum(totals.values()), *(totals[k] for k in OUTCOMES), f"{doc['tests_s']:.0f}"]
    lines += ["| " + " | ".join(f"**{x}**" for x in cells) + " |", ""]
    bad = [(t["outcome"], t["nodeid"], t["message"]) for r in doc["files"] for t in r["tests"]]
    bad = [b for b in bad if b[0] in ("failed", "timed_out", "not_run")]
    lines += [f"- {o.replace('_', ' ')}: `{n}`" + (f": {m}" if m else "") for o, n, m in bad]
    lines += [f"- collection error: `{e['nodeid']}`: {e['message']}" for e in doc["collect_errors"]]
    lines += ["", f"benchmark: {doc['bench']}", f"wall time: {doc['wall_s']:.0f} s of {doc['budget_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, doc: dict[str, Any]) -> str:
    """Write ``summary.json`` and ``summary.md`` under ``out`` and return the Markdown."""
    text = summary_text(doc)
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "summary.md").write_text(text)
    return text


def run_bench(out: Path, left_s: float, workloads: str = "resnet50-float") -> str:
    """The GPU headline benchmark in its own process, asked to fit its work in ``left_s`` less
    :data:`BENCH_MARGIN_S` and killed at ``left_s``; one line on how it went."""
    bench_out = out / "bench"
    budget = f"{left_s - BENCH_MARGIN_S:.0f}"
    cmd = [sys.executable, "-u", "-m", "benchmarks.gpu", "--out", str(bench_out), "--budget-s", budget]
    cmd += ["--workloads", workloads]
    started = time.monotonic()
    with open(out / "bench.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=left_s)
        except subprocess.TimeoutExpired:
            _kill_family(proc.pid)
            proc.wait(KILL_GRACE_S)
            return f"killed after {time.monotonic() - started:.0f} s (its tables so far are in {bench_out})"
    wall = time.monotonic() - started
    if code != 0:
        return f"failed (exit code {code}) after {wall:.0f} s: see {out / 'bench.log'}"
    return f"finished in {wall:.0f} s: {bench_out / 'gpu.md'}"


def _kill_family(pid: int) -> None:
    """Kill process ``pid`` and every process it started, by their ids."""
    import psutil

    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    for member in family:
        try:
            member.kill()
        except psutil.Error:
            pass


def machine_line() -> str:
    """The GPU, its driver and the versions, read without starting CUDA in this process (its
    context would hold memory through every test file)."""
    import torch

    gpu = "GPU unknown (no nvidia-smi)"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
        gpu = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else gpu
    return f"{gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); {os.cpu_count()} CPUs"


def run_tests(out: Path, files: dict[str, list[dict]], doc: dict[str, Any], started: float, deadline: float) -> None:
    """Each file in :func:`order`, with its share of the time left before ``deadline`` (a
    ``time.monotonic()`` instant, as ``started``); the summary is rewritten after each."""
    names = order(files)
    for i, path in enumerate(names):
        left = deadline - time.monotonic()
        share = file_share(left, weight(files[path]), sum(weight(files[n]) for n in names[i:]))
        if share < MIN_FILE_S:
            rec = not_started(path, files[path], f"not started: {max(left, 0):.0f} s were left for the tests")
        else:
            n = len(files[path])
            log_line(out, f"{path}: {n} gpu test{'' if n == 1 else 's'}, {share:.0f} s")
            rec = run_file(path, files[path], share, out)
        doc["files"].append(rec)
        counts = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in rec["counts"].items() if v)
        log_line(
            out, f"{path}: {counts} in {rec['wall_s']:.0f} s" + (" (killed at its limit)" if rec["killed"] else "")
        )
        doc["tests_s"] = sum(r["wall_s"] for r in doc["files"])
        doc["wall_s"] = time.monotonic() - started
        write_summary(out, doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.check", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("gpu-check-logs"), help="log directory (default gpu-check-logs)"
    )
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for everything (default 480)")
    parser.add_argument("--bench-s", type=float, help=f"seconds kept for the benchmark (default {BENCH_SHARE:.0%}%)")
    parser.add_argument("--no-bench", action="store_true", help="run the tests only")
    parser.add_argument(
        "--workloads",
        default="resnet50-float",
        help="the benchmark's workloads (default resnet50-float: one workload, so its search gets minutes, not seconds)",
    )
    parser.add_argument(
        "--rerun", type=Path, metavar="SUMMARY_JSON",
        help="run only the tests that failed, timed out or did not run in this earlier check's summary.json",
    )  # fmt: skip
    parser.add_argument("paths", nargs="*", default=["tests"], help="where to collect gpu tests (default tests)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"The GPU check needs a CUDA GPU, and torch {torch.__version__} sees none here.", file=sys.stderr)
        return 2
    done = None
    if args.rerun is not None:  # read before anything runs (and before --out's summary is rewritten)
        try:
            done = finished(args.rerun)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"--rerun {args.rerun}: not an earlier check's summary.json ({e!r})", file=sys.stderr)
            return 2
    started = time.monotonic()
    deadline = started + args.budget_s
    bench_s = 0.0 if args.no_bench else (args.bench_s if args.bench_s is not None else BENCH_SHARE * args.budget_s)
    out = args.out.resolve()
    (out / "tests").mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_line()}
    doc.update(budget_s=args.budget_s, wall_s=0.0, tests_s=0.0, files=[], collect_errors=[], bench="not run")
    log_line(out, f"GPU check: {doc['machine']}; budget {args.budget_s:.0f} s, {bench_s:.0f} s kept for the benchmark")
    if importlib.util.find_spec("pytest_timeout") is None:
        log_line(
            out, "pytest-timeout is not installed: a hanging test costs its whole file (pip install pytest-timeout)"
        )
    files, doc["collect_errors"] = collect(out, tuple(args.paths))
    log_line(out, f"collected {sum(map(len, files.values()))} gpu tests in {len(files)} files")
    if done is not None:
        files = unfinished(files, done)
        log_line(out, f"--rerun: {sum(map(len, files.values()))} tests that {args.rerun} left unfinished")
    for e in doc["collect_errors"]:
        log_line(out, f"collection error: {e['nodeid']}: {e['message']}")
    run_tests(out, files, doc, started, deadline - bench_s)
    left = deadline - time.monotonic()
    if args.no_bench:
        doc["bench"] = "not run (--no-bench)"
    elif left < MIN_BENCH_S:
        doc["bench"] = f"not run: {max(left, 0):.0f} s were left"
    else:
        log_line(out, f"benchmark: python -m benchmarks.gpu, {left:.0f} s")
        doc["bench"] = run_bench(out, left, args.workloads)
    doc["wall_s"] = time.monotonic() - started
    log_line(out, f"benchmark: {doc['bench']}")
    print("\n" + write_summary(out, doc), flush=True)
    counts = [r["counts"] for r in doc["files"]]
    clean = all(c["failed"] + c["timed_out"] + c["not_run"] == 0 for c in counts) and not doc["collect_errors"]
    return 0 if clean and (args.no_bench or doc["bench"].startswith("finished")) else 1


if __name__ == "__main__":
    sys.exit(main())
