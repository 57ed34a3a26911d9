"""How the ``autotune`` command prints a run: the space it searches; the end of a run in a few
lines (:func:`_print_ending`: the claim, what changed, the artifacts, where the rest is and how to
use it); and the whole result (:func:`_print_result`: the table, notes, the search's story, where
the time went, the runtimes, the Pareto front), for ``--verbose`` and ``autotune show``."""

from __future__ import annotations

from typing import Any


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


def _print_ending(console: Any, result: Any, *, quiet: bool = False) -> None:
    """The end of a run in about ten lines; with ``quiet``, the claim and the folder alone."""
    import json

    from autotune.report.summary import claim_text

    path = result.out_dir / "best_config.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    headline, sentence = claim_text(saved.get("speedup") or {})
    colour = "green" if result.verdict == "speedup" else "yellow"
    say = lambda text: console.print(text, highlight=False, soft_wrap=True)  # noqa: E731
    claim = result.claim or sentence or headline
    say(f"[bold {colour}]speedup: {headline}[/bold {colour}]  {_escape(claim)}")
    if quiet:
        say(f"results in {result.out_dir}/")
        return
    base, best = result.baseline.get("metric"), result.best.get("metric")
    if base is not None and best is not None:
        guard = (saved.get("guard") or {}).get("max_metric_drop")
        held = f" (allowed drop {guard:g})" if isinstance(guard, (int, float)) else ""
        say(f"metric: {base:.4f} -> {best:.4f}{held}")
    say(
        f"changed: {_changes(saved.get('baseline_config') or {}, result.best_config) or 'nothing (the baseline stands)'}"
    )
    for note in filter(None, [_why(result), _busy_note(result)]):
        say(f"[yellow]{_escape(note)}[/yellow]")
    artifacts = saved.get("artifacts") or {}
    if artifacts:
        say(f"artifacts: {_escape(_artifacts_line(artifacts))}")
    counts = _counts(result)
    elapsed = (saved.get("time") or {}).get("total_s")
    took = f" in {int(elapsed) // 60}:{int(elapsed) % 60:02d}" if elapsed else ""
    more = f"; {len(result.notes)} note{'s' * (len(result.notes) != 1)} in the report" if result.notes else ""
    say(f"stopped: {result.stop_reason}{took}{counts}{more}")
    out = result.out_dir
    say(f"report: {out}/report.html (or report.md); every detail: autotune show {out}")
    say(f'use it: fast = autotune.apply(model, "{out}"); loader = autotune.dataloader(dataset, "{out}"); '
        f'or serve the artifact: autotune.load("{out}").predict(inputs)')  # fmt: skip


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _changes(baseline: dict[str, Any], best: dict[str, Any]) -> str:
    """The knobs the winner set off the baseline's values: ``batch_size 32 -> 512, ...``."""
    from autotune.knobs import REGISTRY

    return ", ".join(
        f"{k} {baseline.get(k)} -> {v}"
        for k, v in best.items()
        if k in baseline and baseline[k] != v and (k not in REGISTRY or REGISTRY[k].applies(best))
    )


def _why(result: Any) -> str | None:
    diagnosis = result.diagnosis or {}
    return f"why it won: {diagnosis['summary']}" if diagnosis.get("summary") else None


def _artifacts_line(artifacts: dict[str, Any]) -> str:
    parts = []
    for fmt, art in artifacts.items():
        if art.get("status") == "ok":
            files = " + ".join(filter(None, [art.get("path"), art.get("bin_path")]))
            note = "" if art.get("winner") is not False else ", not the measured winner"
            parts.append(f"{files} ({fmt}, parity ok{note})")
        else:
            parts.append(f"{fmt} FAILED ({art.get('error') or (art.get('parity') or {}).get('reason') or 'unknown'})")
    return "; ".join(parts)


def _counts(result: Any) -> str:
    if result.study is None:
        return ""
    from autotune.record import trial_record
    from autotune.report.summary import trial_counts

    counts = trial_counts([trial_record(t) for t in result.study.get_trials(deepcopy=False)])
    by = ", ".join(f"{n} {status}" for status, n in counts["by_status"].items())
    return f" after {counts['n_measured']} trials ({by})"


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
        from autotune.record import trial_record
        from autotune.report.summary import trial_counts, trials_sentence

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
    from autotune.report.story import story_lines

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
    from autotune.report.breakdown import OPEN_TRACES, changed_operators, limits

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

    from autotune.record import trial_record
    from autotune.report.summary import busy_note

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

    from autotune.record import trial_record
    from autotune.report.summary import best_by

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
        table.add_row(
            runtime,
            f"{rec['samples_per_s']:,.0f}",
            f"{rec['samples_per_s'] / torch_sps:.2f}x",
            f"{rec.get('metric_drop', 0):+.4f}",
            str(rec["number"]),
            _in_brief(rec["config"]),
        )
    console.print(table)


def _print_pareto(console: Any, result: Any) -> None:
    from rich.table import Table

    from autotune.report.summary import format_value

    keys = ["samples_per_s", "latency_ms_p95", "size_bytes_compressed", "peak_mem_mib", "metric"]
    table = Table(title="feasible Pareto front (pareto.json)")
    for col in ("trial", *keys, "changes"):
        table.add_column(col)
    for member in result.pareto:
        table.add_row(
            str(member["trial"]), *(format_value(k, member.get(k)) for k in keys), _in_brief(member["config"])
        )
    console.print(table)


def _in_brief(config: dict[str, Any]) -> str:
    """A configuration in a few words: its batch size, then every knob it sets off its default
    where the knob applies (a runtime's precision with its runtime)."""
    from autotune.knobs import REGISTRY

    shown = {
        name: value
        for name, value in config.items()
        if name in REGISTRY and REGISTRY[name].default not in (None, value) and REGISTRY[name].applies(config)
    }
    shown = {"batch_size": config.get("batch_size"), **shown}  # first, changed or not
    return " ".join(f"{name}={value}" for name, value in shown.items())
