"""The commands that measure: ``autotune run`` (its flags, the options it passes on), ``collect``
and ``profile``."""

from __future__ import annotations

import argparse
from typing import Any

from autotune.cli.printing import _print_ending, _print_result, _print_space
from autotune.errors import ConfigError


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
    run.add_argument(
        "--quiet", action="store_true", help="no progress: print only the claim and the output folder at the end"
    )
    run.add_argument(
        "--verbose", action="store_true", help="end with every detail (as autotune show), not the short ending"
    )
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
    if args.verbose:
        _print_result(console, result)
    else:
        _print_ending(console, result, quiet=args.quiet)
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
