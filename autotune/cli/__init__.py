"""The ``autotune`` command: argument parsing and printing around library calls."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from autotune.errors import AutotuneError, ConfigError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotune", description="Tune a PyTorch model's inference pipeline end to end."
    )
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
    status.add_argument("out_dir", nargs="?", help="a run's output directory (its study.db)")
    status.add_argument("--storage", help="the study's database URL instead of an output directory")
    status.add_argument("--study", help="study name (needed when the storage holds several)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _run_parser(run: argparse.ArgumentParser) -> None:
    """The arguments of ``autotune run``."""
    run.add_argument("cfg", help="Python file defining model and dataset (and optionally metric, space, options)")
    run.add_argument("--trials", type=int, help="measured trials in the study (default 30)")
    run.add_argument(
        "--timeout", type=float, help="seconds for the whole run: search, confirmation, export (within a margin)"
    )
    run.add_argument(
        "--trial-timeout",
        type=float,
        help="seconds one trial may take (default: adaptive, 10x the baseline trial, at least 30 s, +120 s to compile)",
    )
    run.add_argument("--out", help="output directory (default autotune-out)")
    run.add_argument("--device", help="auto, cpu, cuda or cuda:N (default auto)")
    run.add_argument("--space", help="preset name or TOML file (default: default)")
    run.add_argument("--fix", action="append", default=[], metavar="NAME=VALUE", help="pin a knob (repeatable)")
    run.add_argument("--storage", help="Optuna storage URL (default sqlite:///OUT/study.db)")
    run.add_argument("--study", help="study name (default autotune)")
    run.add_argument("--resume", action="store_true", help="continue an existing study")
    run.add_argument(
        "--join", action="store_true", help="share the study with other workers (created by whichever starts first)"
    )
    run.add_argument("--devices", help="one worker per device, sharing the study: GPU indices (0,1,2,3) or cpu,cpu")
    run.add_argument("--heartbeat", type=int, metavar="S", help="seconds between heartbeats of a trial (default 30)")
    run.add_argument("--grace", type=int, metavar="S", help="seconds without heartbeat: worker dead (default 180)")
    run.add_argument("--seed", type=int, help="sampler and torch seed (default 0)")
    run.add_argument(
        "--strategy",
        choices=("staged", "tpe"),
        help="staged (default): screen each lever, compose those that paid, then TPE; tpe: TPE after a warm start",
    )
    run.add_argument("--export", help="artifacts of the winner: onnx,torchscript (default) or none")
    run.add_argument("--no-profile", action="store_true", help="skip profiling the baseline and the winner")
    run.add_argument("--budget", help="wall time for the whole run, planned to end in it: 300, 90s, 5m, 1h30m")
    reread = "the same samples are read again in use (repeated evaluation of a fixed set): caches may pay"
    run.add_argument("--repeated-passes", action="store_true", help=reread)
    run.add_argument("--isolation", choices=("subprocess", "inprocess"), help="where trials run (default subprocess)")
    run.add_argument("--dry-run", action="store_true", help="print the resolved search space and exit")
    run.add_argument("--quiet", action="store_true", help="print only the final table")
    run.add_argument("--json", action="store_true", help="print only the result as JSON on stdout (progress on stderr)")
    run.add_argument("--debug", action="store_true", help="show tracebacks")


def _collect_parser(collect: argparse.ArgumentParser) -> None:
    """The arguments of ``autotune collect``."""
    collect.add_argument("cfg", help="the cfg.py the workers ran (its model, dataset and options)")
    collect.add_argument("--storage", required=True, help="the study's storage URL, as the workers were given it")
    collect.add_argument("--study", help="study name (default autotune)")
    collect.add_argument("--out", help="output directory (default autotune-out)")
    collect.add_argument("--device", help="auto, cpu, cuda or cuda:N, like the workers' (default auto)")
    collect.add_argument("--export", help="artifacts of the winner: onnx,torchscript (default) or none")
    collect.add_argument("--timeout", type=float, help="seconds for the whole collect, export within a margin")
    collect.add_argument("--json", action="store_true", help="print only the result as JSON")
    collect.add_argument("--debug", action="store_true", help="show tracebacks")


def _collect(args: argparse.Namespace, console: Any) -> int:
    import json

    from autotune.run.cfg import load_config
    from autotune.run.collect import collect_options
    from autotune.run.options import Options

    cfg = load_config(args.cfg)
    flags = {"storage": args.storage, "study_name": args.study, "out_dir": args.out, "device": args.device}
    flags.update(timeout=args.timeout, export=_formats(args.export), join=True)
    result = collect_options(cfg["model"], cfg["dataset"], Options.from_cfg(cfg, flags, where=args.cfg))
    if args.json:
        from autotune.report.data import run_summary

        print(json.dumps(run_summary(result.out_dir), indent=2, default=str))
        return 0
    _print_result(console, result)
    return 0


def _formats(export: str | None) -> tuple[str, ...] | None:
    """``--export onnx,torchscript`` as the ``export`` option."""
    return None if export is None else tuple(f.strip() for f in export.split(",") if f.strip())


def _parse_fix(items: list[str]) -> dict[str, Any]:
    from autotune.knobs import get_knob

    fixed = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--fix takes NAME=VALUE (for example --fix amp_dtype=bfloat16), but got {item!r}.")
        fixed[name.strip()] = get_knob(name.strip()).parse(value)
    return fixed


def _options(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """cfg.py's definitions and the run's :class:`~autotune.run.options.Options`: cfg.py's, then the flags'."""
    from autotune.run.cfg import load_config
    from autotune.run.options import Options

    cfg = load_config(args.cfg)
    flags = {
        "n_trials": args.trials,
        "timeout": args.timeout,
        "trial_timeout": args.trial_timeout,
        "out_dir": args.out,
        "device": args.device,
        "space": args.space,
        "storage": args.storage,
        "study_name": args.study,
        "seed": args.seed,
        "strategy": args.strategy,
        "isolation": args.isolation,
        "devices": args.devices,
        "heartbeat_interval_s": args.heartbeat,
        "grace_period_s": args.grace,
        "export": _formats(args.export),
        "resume": True if args.resume else None,
        "join": True if args.join else None,
        "profile": False if args.no_profile else None,
        "repeated_passes": True if args.repeated_passes else None,
        "budget": args.budget,
        "fix": _parse_fix(args.fix) if args.fix else None,
    }
    return cfg, Options.from_cfg(cfg, flags, where=args.cfg)


def _print_space(console: Any, env: Any, data: Any, space: Any) -> None:
    from rich.table import Table

    console.print(
        f"device: {env.device} ({env.gpu_name or env.cpu_capability}); dataset: {data.n_samples} samples, "
        f"sample shapes {dict(data.shapes)}"
    )
    table = Table(title=f"search space (up to {space.size():,} configurations)")
    table.add_column("knob")
    table.add_column("candidates")
    table.add_column("baseline")
    table.add_column("left out (why)")
    for name, values in space.values.items():
        by_reason: dict[str, list[str]] = {}
        for value, why in space.excluded.get(name, {}).items():
            by_reason.setdefault(why, []).append(value)
        left = "\n".join(f"{', '.join(vs)}: {why}" for why, vs in by_reason.items())  # one reason a line
        table.add_row(name, ", ".join(map(str, values)), str(space.baseline[name]), left)
    console.print(table)


def _print_result(console: Any, result: Any) -> None:
    from rich.table import Table

    from autotune.report.summary import summary_rows

    table = Table(title=_result_title(result))
    table.add_column("")
    table.add_column("baseline", justify="right")
    table.add_column("best", justify="right")
    for row in summary_rows(result.baseline, result.best):
        table.add_row(*row)
    console.print(table)
    if result.claim:
        colour = "green" if result.verdict == "speedup" else "yellow"
        console.print(f"[{colour}]{result.claim}[/{colour}]", highlight=False, soft_wrap=True)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if result.study is not None:  # the count the progress lines and both reports give
        from autotune.report.summary import trial_counts, trials_sentence
        from autotune.search.record import trial_record

        counts = trial_counts([trial_record(t) for t in result.study.get_trials(deepcopy=False)])
        console.print(f"trials: {trials_sentence(counts)}", highlight=False, soft_wrap=True)
    busy = _busy_note(result)
    if busy:
        console.print(f"[yellow]{busy}[/yellow]", highlight=False, soft_wrap=True)
    diagnosis = result.diagnosis or {}
    if diagnosis.get("summary") or diagnosis.get("error") or diagnosis.get("fault"):
        why = diagnosis.get("summary") or (
            f"not shown: {diagnosis['fault']}" if diagnosis.get("fault") else f"not measured: {diagnosis['error']}"
        )
        console.print(f"why it won: {why}", highlight=False, soft_wrap=True)
    from autotune.search.phases import story_lines

    for line in story_lines(result.search):
        console.print(line, highlight=False, soft_wrap=True)
    _print_profile(console, result)
    if result.pareto:
        _print_pareto(console, result)
    _print_runtimes(console, result)
    held = result.held_out
    if held and "error" not in held:
        console.print(
            f"held-out test metric ({held['n_samples']} samples): baseline {held['baseline']:.4f}, "
            f"best {held['best']:.4f} (drop {held['drop']:+.4f})",
            highlight=False,
        )
    elif held:
        console.print(f"held-out test metric: not measured: {held['error']}", highlight=False)
    _print_artifacts(console, result)
    console.print(f"best config: {result.best_config}", highlight=False, soft_wrap=True)
    names = ("best_config.json", "trials.csv", "study.db", "report.html", "report.md", "trace-baseline.json.gz")
    names += ("trace-best.json.gz",)
    files = ", ".join(n for n in names if (result.out_dir / n).exists())
    console.print(f"files in {result.out_dir}/: {files}  (stopped: {result.stop_reason})", highlight=False)


def _print_profile(console: Any, result: Any) -> None:
    from autotune.report.breakdown import changed_operators, limits
    from autotune.run.profile import OPEN_TRACES

    profile = result.profile or {}
    if "best" not in profile:
        if profile.get("error"):
            console.print(f"where the time goes: {profile['error']}", highlight=False, soft_wrap=True)
        return
    for label, key in (("baseline", "baseline"), ("winner", "best")):
        top = ", ".join(f"{o['name']} {o['share']:.0%}" for o in profile[key]["operators"][:3])
        wait = profile[key]["stages"].get("loader_wait", {}).get("share", 0.0)
        console.print(f"where the time goes ({label}): {top}; loader wait {wait:.0%}", highlight=False, soft_wrap=True)
    for line in filter(None, [changed_operators(profile), *limits(profile)]):
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    traces = " and ".join(profile[k]["trace"] for k in ("baseline", "best"))
    console.print(f"traces: {traces}: {OPEN_TRACES}", highlight=False, soft_wrap=True)


def _busy_note(result: Any) -> str | None:
    """The report's warning when the machine was busy during the run, for the terminal."""
    import json

    from autotune.report.summary import busy_note
    from autotune.search.record import trial_record

    path = result.out_dir / "best_config.json"
    speedup = (json.loads(path.read_text()).get("speedup") or {}) if path.exists() else {}
    records = [trial_record(t) for t in result.study.get_trials(deepcopy=False)] if result.study is not None else []
    return busy_note(records, speedup)


def _result_title(result: Any) -> str:
    """The summary table's title: the claim, in the same words as the report."""
    if result.verdict == "speedup":
        return (
            f"baseline vs best  (speedup {result.speedup:.2f}x, 95% CI {result.speedup_min:.2f}-"
            f"{result.speedup_max:.2f}x, confirmation rounds)"
        )
    if result.verdict == "slower":
        return "baseline vs best  (the pick was measurably slower than the baseline: no speedup)"
    if result.verdict == "noisy":
        return "baseline vs best  (no speedup claimed: the machine was too busy to measure one reliably)"
    if result.verdict == "failed":
        return "baseline vs best  (trials' figures; no speedup claimed: the confirmation rounds failed, see below)"
    if result.verdict == "unconfirmed":
        return f"baseline vs best  ({result.speedup:.2f}x from the trials alone, NOT confirmed)"
    return "baseline vs best  (no measurable speedup: the baseline stands)"


def _print_artifacts(console: Any, result: Any) -> None:
    import json

    path = result.out_dir / "best_config.json"
    artifacts = json.loads(path.read_text()).get("artifacts", {}) if path.exists() else {}
    for fmt, art in artifacts.items():
        parity = art.get("parity") or {}
        if art.get("status") == "ok":
            console.print(
                f"[green]{fmt}[/green]: {art['path']} ({art['bytes'] / 2**20:.2f} MiB), parity ok "
                f"(max abs {parity.get('max_abs', 0):.2g}, rel L2 {parity.get('rel_l2', 0):.2g})"
                + (f"; {art['form_note']}" if art.get("form_note") else "")
                + (
                    "; NOT the measured winner: the speedup is not its own, `autotune verify` times it"
                    if art.get("winner") is False
                    else ""
                ),
                highlight=False,
            )
        else:
            why = art.get("error") or parity.get("reason") or "unknown"
            console.print(f"[red]{fmt}: FAILED[/red] - {why}", highlight=False, soft_wrap=True)


def _print_runtimes(console: Any, result: Any) -> None:
    """When several runtimes were measured: the fastest trial of each, against torch's."""
    from rich.table import Table

    from autotune.knobs import REGISTRY
    from autotune.report.summary import best_by
    from autotune.search.record import trial_record

    if result.study is None:  # `autotune show` of a run whose storage cannot be opened
        return
    best = best_by([trial_record(t) for t in result.study.get_trials(deepcopy=False)], "runtime")
    if len(best) < 2 or "torch" not in best:
        return
    torch_sps = best["torch"]["samples_per_s"]
    table = Table(title="fastest trial per runtime (each measured end to end, guard held)")
    for col in ("runtime", "samples/s", "vs torch", "metric drop", "trial", "its settings"):
        table.add_column(col)
    for runtime, rec in sorted(best.items(), key=lambda kv: -kv[1]["samples_per_s"]):
        keys = ("batch_size", "ort_precision", "quantization", "amp_dtype", "compile_mode", "num_threads")
        settings = " ".join(f"{k}={rec['config'][k]}" for k in keys if REGISTRY[k].applies(rec["config"]))
        table.add_row(
            runtime,
            f"{rec['samples_per_s']:,.0f}",
            f"{rec['samples_per_s'] / torch_sps:.2f}x",
            f"{rec.get('metric_drop', 0):+.4f}",
            str(rec["number"]),
            settings,
        )
    console.print(table)


def _print_pareto(console: Any, result: Any) -> None:
    from rich.table import Table

    from autotune.knobs import REGISTRY
    from autotune.report.summary import format_value

    keys = ["samples_per_s", "latency_ms_p95", "size_bytes_compressed", "peak_mem_mib", "metric"]
    table = Table(title="feasible Pareto front (pareto.json)")
    for col in ("trial", *keys, "changes"):
        table.add_column(col)
    for member in result.pareto:
        changes = " ".join(
            f"{k}={v}"
            for k, v in member["config"].items()
            if REGISTRY[k].default not in (None, v) and k != "batch_size"
        )
        changes = f"batch_size={member['config']['batch_size']} {changes}"
        table.add_row(str(member["trial"]), *(format_value(k, member.get(k)) for k in keys), changes)
    console.print(table)


def _run(args: argparse.Namespace, console: Any) -> int:
    from rich.console import Console

    from autotune.run.plan import plan
    from autotune.run.stages import execute

    cfg, options = _options(args)
    if args.dry_run:
        env, data, space = plan(cfg["model"], cfg["dataset"], **options.plan_args())
        _print_space(console, env, data, space)
        return 0
    import contextlib
    import json

    from autotune.run.progress import make_progress

    out = options.out_dir
    # With --json, stdout carries the JSON alone: progress and messages go to stderr.
    shown = Console(stderr=True) if args.json else console
    progress = make_progress(shown, timeout=options.limit_s, n_trials=options.n_trials, quiet=args.quiet)
    try:
        with progress if progress is not None else contextlib.nullcontext():
            result = execute(cfg["model"], cfg["dataset"], options.replace(progress=progress))
    except KeyboardInterrupt:
        shown.print(f"Interrupted: every finished trial is saved in {out}/. Continue with --resume.")
        return 130
    from autotune.run.hints import space_note

    result.notes.extend(filter(None, [space_note(options)]))
    if args.json:
        from autotune.report.data import run_summary

        print(json.dumps(run_summary(result.out_dir), indent=2, default=str))
        return 0
    _print_result(console, result)
    return 0


def _profile(args: argparse.Namespace, console: Any) -> int:
    from pathlib import Path

    from autotune.report.breakdown import top_rows
    from autotune.run.cfg import load_config
    from autotune.run.profile import OPEN_TRACES, profile

    if args.config is not None and not Path(args.config).exists():
        raise ConfigError(f"No config at {args.config!r}: give --config a best_config.json or a run's directory.")
    cfg = load_config(args.cfg)
    options = cfg.get("options") or {}
    summary = profile(
        cfg["model"],
        cfg["dataset"],
        args.config,
        out_dir=args.out,
        device=args.device,
        mode=cfg.get("mode", options.get("mode", "inference")),
        loss_fn=cfg.get("loss_fn", options.get("loss_fn")),
        optimizer=cfg.get("optimizer", options.get("optimizer")),
        collate_fn=cfg.get("collate_fn", options.get("collate_fn")),
        pad_values=options.get("pad_values"),
    )
    stages = ", ".join(f"{k} {v['share']:.0%}" for k, v in summary["stages"].items())
    families = ", ".join(f"{k} {v['share']:.0%}" for k, v in summary["families"].items() if v["share"] >= 0.01)
    console.print(f"stages: {stages}\noperator families: {families}", highlight=False, soft_wrap=True)
    for row in top_rows(summary):
        console.print(
            f"  {row[3]:>6}  {row[0]}  ({row[1]}; {row[2]} ms/step; {row[4]} calls; {row[5]})", highlight=False
        )
    out = Path(args.out)
    console.print(f"wrote {out / summary['trace']}: {OPEN_TRACES}", highlight=False, soft_wrap=True)
    return 0


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

    from autotune.doctor.core import SECTIONS

    styles = {"ok": "green", "info": "blue", "warn": "yellow", "fail": "bold red"}
    table = Table(title="autotune doctor", expand=True)
    for col in ("section", "check", "status"):
        table.add_column(col, no_wrap=True)
    table.add_column("detail", ratio=3)
    table.add_column("what to do", ratio=2)
    for section in SECTIONS:
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

    from rich.table import Table

    from autotune.search.status import out_dir_status, study_status

    if (args.out_dir is None) == (args.storage is None):
        raise ConfigError("autotune status takes an output directory or --storage URL (with --study NAME), not both.")
    data = study_status(args.storage, args.study) if args.storage else out_dir_status(args.out_dir, args.study)
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


if __name__ == "__main__":
    sys.exit(main())
