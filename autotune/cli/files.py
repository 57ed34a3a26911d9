"""The commands that read what is already there: a finished run's output directory (``verify``,
``report``, ``show``, ``dashboard``), a study's storage (``status``) and this machine (``doctor``)."""

from __future__ import annotations

import argparse
from typing import Any

from autotune.cli.printing import _print_result
from autotune.errors import ConfigError


def _verify(args: argparse.Namespace, console: Any) -> int:
    import json

    from rich.table import Table

    from autotune.deploy.verify import verify

    report = verify(args.out_dir, device=args.device)
    code = 0 if all(a["status"] == "ok" for a in report["artifacts"].values()) else 1
    if args.json:
        print(json.dumps(report, indent=2))
        return code
    notes = report["throughput_notes"]
    table = Table(title=f"artifacts of {args.out_dir} on {report['device']}")
    for col in ("format", "status", "max abs", "rel L2", "fidelity", "samples/s*", "reason"):
        table.add_column(col, justify="right" if col in ("max abs", "rel L2", "fidelity", "samples/s*") else "left")
    for fmt, art in report["artifacts"].items():
        style = "green" if art["status"] == "ok" else "red"
        nums = [f"{art[k]:.3g}" if art[k] is not None else "-" for k in ("max_abs", "rel_l2", "fidelity")]
        sps = f"{art['samples_per_s']:,.0f}" if art["samples_per_s"] is not None else "-"
        table.add_row(fmt, f"[{style}]{art['status']}[/{style}]", *nums, sps, art["reason"] or "")
    console.print(table)
    recorded = report["recorded_samples_per_s"]
    console.print(f"* {notes['samples_per_s']}.", highlight=False)
    if recorded is not None:
        console.print(
            f"  The search recorded {recorded:,.0f} samples/s for the winner {notes['recorded_samples_per_s']}: "
            "a different measurement, not comparable with samples/s*.",
            highlight=False,
            soft_wrap=True,
        )
    if not report["env_diff"]:
        console.print("environment: same hardware and software as recorded")
        return code
    env = Table(title="environment: changed since the search")
    for col in ("", "recorded", "current"):
        env.add_column(col)
    for row in report["env_diff"]:
        env.add_row(row["key"], str(row["recorded"]), str(row["current"]))
    console.print(env)
    return code


def _print_checks(console: Any, checks: list[Any]) -> None:
    """The doctor's checks in one table, section by section; problems carry what to do."""
    from rich.table import Table

    from autotune.doctor.core import sections

    styles = {"ok": "green", "info": "blue", "warn": "yellow", "fail": "bold red"}
    table = Table(title="autotune doctor", expand=True)
    for col in ("section", "check", "status"):
        table.add_column(col, no_wrap=True)
    table.add_column("detail", ratio=3)
    table.add_column("what to do", ratio=2)
    for section in sections():  # the registered runtimes' sections among the host's
        rows = [c for c in checks if c.section == section]
        for i, c in enumerate(rows):
            style = styles[c.status]
            table.add_row(section if i == 0 else "", c.name, f"[{style}]{c.status}[/{style}]", c.detail, c.fix or "")
        if rows:
            table.add_section()
    console.print(table)
    counts = {s: sum(c.status == s for c in checks) for s in styles}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()), highlight=False)


def _doctor(args: argparse.Namespace, console: Any) -> int:
    import json

    import autotune.doctor.core as _doctor

    facts = _doctor.gather(".", compile_check=args.compile_check)
    checks = _doctor.diagnose(facts)
    if args.json:
        print(json.dumps({"checks": [c.to_dict() for c in checks], "facts": facts}, indent=2, default=str))
    else:
        _print_checks(console, checks)
    return _doctor.exit_code(checks)


def _report(args: argparse.Namespace, console: Any) -> int:
    from autotune.report.html import write_reports

    paths = write_reports(args.out_dir)
    console.print(f"wrote {paths['html']} and {paths['md']}", highlight=False, soft_wrap=True)
    return 0


def _show(args: argparse.Namespace, console: Any) -> int:
    import json

    from autotune.report.data import load_result, run_summary

    if args.json:
        print(json.dumps(run_summary(args.out_dir), indent=2, default=str))
        return 0
    _print_result(console, load_result(args.out_dir))
    return 0


def _dashboard(args: argparse.Namespace, console: Any) -> int:
    from autotune.report.dashboard import resolve_dashboard, run_dashboard
    from autotune.search.storage import redact

    storage = resolve_dashboard(args.out_dir, args.storage)  # fails before announcing anything
    console.print(
        f"optuna-dashboard on http://{args.host}:{args.port}/ for {redact(storage)} (Ctrl-C stops it)",
        highlight=False,
        soft_wrap=True,
    )
    try:
        run_dashboard(args.out_dir, host=args.host, port=args.port, storage=storage)
    except KeyboardInterrupt:
        return 0
    return 0


def _status(args: argparse.Namespace, console: Any) -> int:
    import json
    from pathlib import Path

    from rich.table import Table

    from autotune.search.status import out_dir_status, study_status

    if args.out_dir is not None and args.storage is not None:
        raise ConfigError("autotune status takes an output directory or --storage URL (with --study NAME), not both.")
    out_dir = args.out_dir
    if out_dir is None and args.storage is None:  # where `autotune run` writes without --out
        out_dir = "autotune-out"
        if not (Path(out_dir) / "study.db").is_file():
            raise ConfigError(
                "No study.db in autotune-out, the default output directory: give the run's own "
                "(autotune status OUT_DIR) or its database (--storage URL --study NAME)."
            )
    data = study_status(args.storage, args.study) if out_dir is None else out_dir_status(out_dir, args.study)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    console.print(f"study {data['study']!r} in {data['storage']}", highlight=False)
    for group in data["groups"]:
        states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(group["states"].items()))
        budget = f"/{group['n_requested']}" if group["n_requested"] else ""
        console.print(
            f"[bold]{group['hardware']}[/bold] (optuna study {group['optuna_study']}): "
            f"{group['n_measured']}{budget} measured; trials: {states or 'none'}",
            highlight=False,
        )
        for label in ("baseline", "best"):
            rec = group[label]
            if rec is not None:
                speed = (
                    f", {rec['trial_ratio']:.2f}x the baseline's trial (unconfirmed)"
                    if rec.get("trial_ratio") and label == "best"
                    else ""
                )
                metrics = ", ".join(
                    f"{k} {v:,.4g}" for k, v in rec.items() if isinstance(v, float) and k != "trial_ratio"
                )
                console.print(f"  {label}: trial {rec['trial']}: {metrics}{speed}", highlight=False)
        if group.get("claim"):
            console.print(f"  finished run: {group['claim'].get('sentence')}", highlight=False, soft_wrap=True)
        table = Table()
        for col in ("worker", "measured", "running", "finished", "last trial at"):
            table.add_column(col)
        for worker, entry in group["workers"].items():
            done = sum(n for s, n in entry["states"].items() if s not in ("RUNNING", "WAITING"))
            running = ", ".join(str(n) for n in entry["running"]) or "-"
            table.add_row(worker, str(entry["n_measured"]), running, str(done), entry["last_at"] or "-")
        console.print(table)
    return 0
