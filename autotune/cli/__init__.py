"""The ``autotune`` command: argument parsing and printing around library calls.

The parser and the dispatch are here; each command is in the module of its kind: ``run``,
``collect`` and ``profile`` in :mod:`autotune.cli.run`, the commands that read a finished run
or this machine (``verify``, ``report``, ``show``, ``dashboard``, ``status``, ``doctor``) in
:mod:`autotune.cli.files`, and the printing of a run's result in :mod:`autotune.cli.printing`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from autotune.cli.files import (  # noqa: F401  (_print_checks re-exported: tests print checks with it)
    _dashboard,
    _doctor,
    _print_checks,
    _report,
    _show,
    _status,
    _verify,
)
from autotune.cli.run import _collect, _collect_parser, _profile, _run, _run_parser
from autotune.errors import AutotuneError

__all__ = ["main"]

# pyproject.toml's [project] name: the distribution installs the `autotune` module under another
# name, since "autotune" on the public index is an unrelated project.
_DISTRIBUTION = "torch-autotune"


def _version() -> str:
    """The installed distribution's version, else (a source tree never installed) the package's own."""
    from importlib import metadata

    try:
        return metadata.version(_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        import autotune

        return getattr(autotune, "__version__", "unknown")


class _Version(argparse.Action):
    """``--version``: the version is looked up when asked for, not on every start."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"autotune {_version()}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotune", description="Tune a PyTorch model's inference pipeline end to end."
    )
    parser.add_argument("--version", action=_Version, help="print autotune's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub.add_parser("run", help="tune the model and dataset defined in a cfg.py"))
    _collect_parser(sub.add_parser("collect", help="the one winner of a shared study: re-measured here, written once"))
    prof = sub.add_parser("profile", help="profile one configuration: a Chrome trace and the top operators")
    prof.add_argument("cfg", help="Python file defining model and dataset, as for run")
    prof.add_argument("--config", help="a best_config.json or a run's output directory (default: the baseline)")
    prof.add_argument("--out", default="autotune-profile", help="where the trace goes (default autotune-profile)")
    prof.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    prof.add_argument("--debug", action="store_true", help="show tracebacks")
    spaces = sub.add_parser("spaces", help="list the search space presets")
    spaces.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    verify = sub.add_parser("verify", help="re-check a run's exported artifacts on this machine")
    verify.add_argument("out_dir", help="the run's output directory")
    verify.add_argument("--device", help="cpu, cuda or cuda:N (default: the run's device where this machine has it)")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.add_argument("--debug", action="store_true", help="show tracebacks")
    report = sub.add_parser("report", help="write report.html and report.md of a finished run")
    report.add_argument("out_dir", help="the run's output directory")
    report.add_argument("--debug", action="store_true", help="show tracebacks")
    show = sub.add_parser("show", help="print the summary of a finished run from its files")
    show.add_argument("out_dir", help="the run's output directory")
    show.add_argument("--json", action="store_true", help="print the summary as JSON")
    show.add_argument("--debug", action="store_true", help="show tracebacks")
    dashboard = sub.add_parser("dashboard", help="open a run's study in optuna-dashboard (extra: dashboard)")
    dashboard.add_argument("out_dir", help="the run's output directory")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    dashboard.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    dashboard.add_argument("--storage", help="storage URL to open instead of the recorded one (e.g. with its password)")
    dashboard.add_argument("--debug", action="store_true", help="show tracebacks")
    doctor = sub.add_parser("doctor", help="check this machine before tuning: versions, GPUs, compilers, providers")
    doctor.add_argument("--json", action="store_true", help="print the checks and the facts behind them as JSON")
    doctor.add_argument(
        "--compile-check", action="store_true", help="also compile a tiny function on each device (10-20 s each)"
    )
    doctor.add_argument("--debug", action="store_true", help="show tracebacks")
    status = sub.add_parser("status", help="progress of a study, also while its workers run")
    status.add_argument("out_dir", nargs="?", help="a run's output directory (its study.db; default autotune-out)")
    status.add_argument("--storage", help="the study's database URL instead of an output directory")
    status.add_argument("--study", help="study name (needed when the storage holds several)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


# The commands that read a finished run's output directory.
_RUN_FILES = {"report": _report, "show": _show, "dashboard": _dashboard}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``autotune`` console script."""
    from rich.console import Console

    args = _parser().parse_args(argv)
    console = Console()
    try:
        if args.command == "spaces":
            from autotune.search.space import list_presets

            for name, description in list_presets().items():
                console.print(f"[bold]{name}[/bold]: {description}", highlight=False)
            return 0
        if args.command == "profile":
            return _profile(args, console)
        if args.command == "verify":
            return _verify(args, console)
        if args.command in ("report", "show", "dashboard"):
            return _RUN_FILES[args.command](args, console)
        if args.command == "doctor":
            return _doctor(args, console)
        if args.command == "status":
            return _status(args, console)
        if args.command == "collect":
            return _collect(args, console)
        return _run(args, console)
    except AutotuneError as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split()) if "\n" not in str(exc).strip() else str(exc).strip().splitlines()[0]
        print(f"autotune: error: {message}", file=sys.stderr)
        return 2
