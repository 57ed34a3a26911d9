"""The third stage of a run (:mod:`autotune.run.stages`): pick among the finalists, confirm the
claim on fresh rounds, diagnose, score the held-out set, export the winner and profile it and the
baseline (:mod:`autotune.run.profile`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autotune.config import values_of
from autotune.errors import TrialError
from autotune.runtimes.base import of_format

__all__ = [
    "export_winner",
    "finalize",
    "finish_reserve",
    "overrun_margin",
    "reserve_s",
    "rounds_budget",
    "worth_selecting",
]

Run = Any  # autotune.run.stages.Run (not imported: stages imports this module)


def finish_reserve(run: Run, records: list[dict[str, Any]]) -> float:
    """Seconds before a run's deadline its search leaves for the finish: the predicted cost of
    confirming and exporting the fastest trial so far (:func:`autotune.search.cost.finish_s`,
    from the measured worker start, builds and timings) with a quarter more for the diagnosis
    and the profile, at most :data:`RESERVE_SHARE` of the run's time limit.

    A fixed share cannot be right for every model: a quarter of 200 s left a compiled
    ResNet-50's confirmation worker one second to start, and is minutes too many for a small MLP.
    The share never takes away the least finish that ends in a confirmed claim (two rounds in the
    search's own worker, then the export): under a 40% cap, a model whose builds take seconds
    reached its finish with too little left to confirm anything.

    While no configuration measured beats the baseline, there is nothing to confirm: the
    reserve is the export's and the reports', so a candidate is measured where it fits (its
    claim then says what the time left could confirm). A 90-s budget of real text refused its
    recipe for the confirmation it would need, and ended at 52 s with the baseline.
    """
    from autotune.search.cost import export_s, finish_s

    ok = [r for r in records if r.get("status") == "ok" and r.get("samples_per_s")]
    baseline = next((r for r in ok if r.get("baseline")), None)
    best = max(ok, key=lambda r: r["samples_per_s"], default=None)
    runner, exports = run.runners[0], bool(run.options.export)
    if baseline is not None and best is not None and best["samples_per_s"] <= baseline["samples_per_s"]:
        return (export_s(baseline) if exports else 0.0) + REPORT_S
    processes = {} if runner.restarts else {"n_processes": 1}
    predicted = finish_s(baseline, best, runner.start_s, diagnose=not run.options.train, exports=exports, **processes)
    least = finish_s(baseline, best, 0.0, diagnose=False, n_rounds=2, n_processes=1, exports=exports)
    return reserve_s(run.options.limit_s, least, predicted)


def reserve_s(limit_s: float, least_s: float, predicted_s: float) -> float:
    """The finish's reserve in a run of ``limit_s`` seconds: the predicted finish and a quarter
    more (at most :data:`RESERVE_SHARE` of the run), never less than the least finish that
    confirms a claim (``least_s``), and never more than :data:`MAX_RESERVE_SHARE` of the run.

    Example:
        >>> reserve_s(600.0, 20.0, 30.0)  # a long run: the prediction and a quarter
        45.5
        >>> reserve_s(180.0, 40.0, 90.0)  # the least finish over the share
        72.0
        >>> reserve_s(90.0, 62.0, 80.0)  # a short budget's search keeps half of it
        45.0
    """
    wanted = max(least_s + REPORT_S, min(RESERVE_SHARE * limit_s, max(5.0, 1.25 * predicted_s) + REPORT_S))
    return min(MAX_RESERVE_SHARE * limit_s, wanted)


# The most of a run's time the finish may keep from the search: a prediction made from the
# baseline alone (a worker start, a trial's wall time) is pessimistic, and on a 45 s quickstart
# run a 60% reserve left the search one trial.
RESERVE_SHARE = 0.4
# Never more than this share of the run, whatever the least finish: a 90-s budget of real text
# kept 67 s for its finish after a 23-s start, refused the recipe trial (15 s) and ended at 45 s
# with the baseline. A finish that does not fit in half the run confirms what its time allows.
MAX_RESERVE_SHARE = 0.5


# With a timeout, the selection and confirmation rounds take at most this share of the time the
# run spent before them (and at least CONFIRM_FLOOR_S): a 25-minute timeout let them take 638 s
# after a 500 s search (57% of the run) to narrow a 3.3-4.5x interval. At a quarter, the finish
# (rounds, export, reports) stays near a quarter of the run.
CONFIRM_SHARE = 0.25
CONFIRM_FLOOR_S = 60.0


# Seconds kept for writing the result files and the reports (report.html's figures): measured
# 4-10 s on 2 busy cores, most of it importing the plotting stack.
REPORT_S = 8.0


def rounds_budget(left_s: float, need_s: float, spent_s: float) -> float:
    """Seconds the selection and confirmation rounds of a run with a timeout may take: what the
    deadline leaves (``left_s``), but no more than :data:`CONFIRM_SHARE` of the ``spent_s`` seconds
    the run took before them, :data:`CONFIRM_FLOOR_S` at least, and never less than 1.5 times the
    least confirmation (``need_s``). Rounds past that only narrow an interval the run already has.

    Example:
        >>> rounds_budget(1000.0, 20.0, 500.0)  # a 500 s search: 125 s of rounds, not 1000
        125.0
        >>> rounds_budget(1000.0, 20.0, 40.0), rounds_budget(30.0, 20.0, 40.0)
        (60.0, 30.0)
    """
    return min(left_s, max(CONFIRM_FLOOR_S, 1.5 * need_s, CONFIRM_SHARE * spent_s))


# A finalist after the first whose build took more than this share of the run before the finish
# (SELECT_BUILD_FLOOR_S at least) is not built again for the selection rounds: its trial's figure
# stands. Two static compiles of trimmed real text, 75 and 87 s each to rebuild width by width,
# made 170 s of a 277-s finish, and neither was picked. At a 20-s floor, a compiled finalist 7%
# behind (a 16-s compile) took 14 s of a two-minute search's 52-s confirmation and was not picked.
SELECT_BUILD_SHARE = 0.1
SELECT_BUILD_FLOOR_S = 5.0


def worth_selecting(
    finalists: list[dict[str, Any]], spent_s: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The finalists the selection rounds build again (the fastest always), and a row for each
    left to its trial's figure because its build costs more than :data:`SELECT_BUILD_SHARE` of
    the ``spent_s`` seconds the run took before its finish.

    Example:
        >>> fast, slow = {"number": 7, "compile_s": 40.0}, {"number": 5, "compile_s": 75.0}
        >>> kept, left = worth_selecting([fast, slow, {"number": 9, "compile_s": 2.0}], 585.0)
        >>> [f["number"] for f in kept], left[0]["trial"]
        ([7, 9], 5)
    """
    from autotune.search.cost import rebuild_s

    limit = max(SELECT_BUILD_FLOOR_S, SELECT_BUILD_SHARE * spent_s)
    kept = finalists[:1] + [f for f in finalists[1:] if rebuild_s(f) <= limit]
    left = [
        {"trial": f.get("number"), "not_selected": f"building it again takes about {rebuild_s(f):.0f} s (its "
         f"trial's build), over the {limit:.0f} s the selection gives one (a tenth of the run before it): its "
         "trial's figure stands"}
        for f in finalists[1:]
        if rebuild_s(f) > limit
    ]  # fmt: skip
    return kept, left


def overrun_margin(timeout: float) -> float:
    """Seconds past a run's ``timeout`` the export of the winner may take: 10% of it, 30 s at
    least (a run ends within ``timeout`` plus this, and the writing of its result files).

    Example:
        >>> overrun_margin(60), overrun_margin(1200)
        (30.0, 120.0)
    """
    return max(30.0, 0.1 * timeout)


def finalize(run: Run) -> None:
    """Pick the winner on selection rounds, claim its speedup on fresh rounds, explain it,
    score the held-out set and export the winner (first, where the pick is known before its
    rounds); each phase's seconds go to ``run.summary["finish"]``."""
    from autotune.run.profile import profile_run
    from autotune.trial.diagnose import diagnose_run

    opts, runner = run.options, run.runners[0]  # the first device's worker confirms and exports
    clock = _Phases(getattr(opts.progress, "finish_phase", None))
    early = _only_pick(run)
    if early is not None:
        # One pick, known before its rounds: exported in the search's worker, which holds the
        # baseline's reference (a fresh worker made it again for the export: 1.7 s of real
        # MiniLM); the rounds then run in fresh workers as ever.
        with clock("export"):
            run.summary["artifacts"] = export_winner(runner, early, run.out, opts.export, run.env, run.summary)
    with clock("confirmation"):
        _confirm(run, runner, exported_s=clock.rows[-1]["seconds"] if early is not None else None)
    with clock("diagnosis"):  # from the confirmation rounds when they timed the halves: no new work
        left = run.left_s()
        if opts.train:
            run.summary["diagnosis"] = None
        elif left is not None and (run.confirmed is None or "loader_samples_per_s" not in run.confirmed["baseline"]):
            # Measuring it apart takes a worker and two builds: under a deadline the export comes
            # first (a 3-minute budget's diagnosis took 26 s and left the export 9 s: no files).
            run.summary["diagnosis"] = {"error": "not measured apart under the run's deadline: the export and the "
                                        f"reports come first ({left:.0f} s were left)"}  # fmt: skip
        else:
            run.summary["diagnosis"] = diagnose_run(runner, run.baseline, run.best, run.confirmed)
    if opts.test_dataset is not None:
        with clock("held-out"):
            run.summary["held_out"] = _held_out(run, runner)
    if run.deadline is not None:  # the export may run past the deadline by the stated margin
        runner.deadline = run.deadline + opts.margin_s
    if early is None or run.best["config"] != early["config"]:  # the baseline kept, say: its files
        _drop_files(run.out, run.summary.get("artifacts") or {})
        with clock("export"):
            run.summary["artifacts"] = export_winner(runner, run.best, run.out, opts.export, run.env, run.summary)
    # Where the time goes, after every timed figure and the export: profiling never touches them.
    left = run.left_s()
    if opts.profile and (left is None or left > 2 * REPORT_S):  # a second or two each, then the reports
        with clock("profile"):
            profile_run(run)
    elif opts.profile:
        run.summary["profile"] = {"error": f"not profiled: {left:.0f} s were left for it and the reports"}
    run.summary["finish"] = clock.rows


class _Phases:
    """Seconds of each phase of the finish, in order."""

    def __init__(self, say: Any = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.say = say  # told as each phase begins: the progress display

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.say is not None:
            self.say(phase)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.rows.append({"phase": phase, "seconds": round(time.perf_counter() - started, 1)})


def _drop_files(out: Path, artifacts: dict[str, Any]) -> None:
    """Remove the files of an export that no longer stands (its pick was not kept)."""
    for record in artifacts.values():
        for name in (record.get("path"), record.get("bin_path")):
            if name:
                (Path(out) / name).unlink(missing_ok=True)
    (Path(out) / "parity.pt").unlink(missing_ok=True)


def _only_pick(run: Run) -> dict[str, Any] | None:
    """The finalist the finish will confirm, where it is the only one (nothing to select) and
    the run has no deadline, exports and infers: it can be exported before its rounds."""
    import autotune.search.select as select
    from autotune.run.rounds import baseline_and_best

    opts = run.options
    # In process, the export's state would stay in the process that times the rounds.
    if run.deadline is not None or not opts.export or opts.train or not run.runners[0].restarts:
        return None
    baseline, _ = baseline_and_best(run.study, run.objectives, run.select)
    finalists = select.finalists(run.records(), run.objectives, baseline["key"], opts.n_finalists, run.select)
    kept, _ = worth_selecting(finalists, _spent_s(run))
    return kept[0] if len(kept) == 1 else None


def _spent_s(run: Run) -> float:
    """Seconds the run took before its finish."""
    times = run.summary.get("time") or {}
    return float(times.get("prepare_s") or 0.0) + float(times.get("search_s") or 0.0)


def _confirm(run: Run, runner: Any, exported_s: float | None = None) -> None:
    """The winner and its claim: selection rounds among the finalists, then fresh rounds of the
    pick against the baseline, in what the deadline leaves; ``exported_s``: the seconds the
    export took, where it is done (a share of the finish already spent)."""
    import autotune.search.select as select
    from autotune.run.output import write_pareto
    from autotune.run.rounds import baseline_and_best, claim_speedup
    from autotune.search.cost import export_s, finish_s

    opts = run.options
    run.baseline, run.best = baseline_and_best(run.study, run.objectives, run.select)
    records = run.records()
    run.front = write_pareto(run.out, records, run.objectives) if len(run.objectives) > 1 else []
    finalists = select.finalists(records, run.objectives, run.baseline["key"], opts.n_finalists, run.select)
    if not finalists:
        return
    spent = _spent_s(run)
    finalists, not_selected = worth_selecting(finalists, spent)
    # A knob fixed away from the baseline's value holds in the winner too: the baseline is
    # then the reference of the claim, never the result (a slower pick says so in the claim).
    speed_only = run.objectives == ["throughput"] and not _fixed_off_baseline(run)
    # With a timeout the rounds take what the search left (the worker is cut off at the
    # deadline too); held-out scoring, when asked, keeps a fifth of it.
    left = run.left_s()
    if left is not None:  # the export and the reports come after, inside the same deadline
        pick = finalists[0]
        left = max(0.0, left - (export_s(pick) if opts.export else 0.0) - REPORT_S)
    # The least confirmation: both builds and two rounds in the search's own worker, as the
    # search's reserve promised it (finish_reserve). Priced with a fresh worker's start, a
    # 3-minute budget's 59 s fell short of it by 5 s and nothing was confirmed.
    need_s = finish_s(run.baseline, finalists[0], 0.0, diagnose=False, n_rounds=2, n_processes=1, exports=False)
    if left is not None:
        left = rounds_budget(left, need_s, spent)
    # Without a time limit the rounds have what keeps the finish within a share of the run: its
    # other costs are predicted from the measured worker start, builds and trials.
    processes = {} if runner.restarts else {"n_processes": 1}
    other_s = REPORT_S + finish_s(run.baseline, finalists[0], runner.start_s, diagnose=not opts.train, n_rounds=0,
                                  exports=bool(opts.export) and exported_s is None, **processes)  # fmt: skip
    other_s += exported_s or 0.0
    budget_s = None if left is None else left * (0.8 if opts.test_dataset is not None else 1.0)
    # The rounds stop at their own budget, not at the run's deadline: what comes after them (the
    # export, the reports) keeps its time even when a round runs long.
    kept = runner.deadline
    if budget_s is not None and kept is not None:
        runner.deadline = min(kept, time.monotonic() + budget_s)
    try:
        run.best, run.confirmed, run.summary["finalists"] = claim_speedup(
            runner, run.baseline, finalists, opts.n_verify_pairs, speed_only, run.timing,
            diagnose=not opts.train, budget_s=budget_s, need_s=need_s, spent_s=spent, other_s=other_s,
        )  # fmt: skip
    finally:
        runner.deadline = kept
    run.summary["finalists"] = [*(run.summary.get("finalists") or []), *not_selected]


def _held_out(run: Run, runner: Any) -> dict[str, Any]:
    """The baseline's and the winner's metric on ``test_dataset``, or why there is none."""
    if run.left_s() == 0.0:
        return {"error": f"not scored: the run's time limit ({run.options.limit_s:g} s) was reached"}
    try:
        return runner.call("held_out", run.baseline["config"], run.best["config"], n_trials=2)
    except TrialError as exc:  # the search's result stands without it
        return {"error": str(exc)}


def _fixed_off_baseline(run: Run) -> list[str]:
    """The knobs ``fix`` pins to another value than the baseline's."""
    config = run.baseline["config"]
    return [name for name in run.options.fix or {} if run.space.values[name] != [config.get(name)]]


def export_winner(
    runner: Any, best: dict[str, Any], out: Path, formats: tuple[str, ...], env: Any, summary: Any = None
) -> dict[str, Any]:
    """Export the winner in the worker; a failure is recorded per format, never raised. The
    batches it was built from, kept beside it (:mod:`autotune.export.build_inputs`), are
    recorded in ``summary["build_inputs"]``."""
    if not formats:
        return {}
    try:
        reply = runner.call("export", best["config"], str(out.resolve()), list(formats), n_trials=2)
    except TrialError as exc:
        return {fmt: {"status": "failed", "error": str(exc)} for fmt in formats}
    artifacts = reply["artifacts"]
    if summary is not None:
        summary["build_inputs"] = reply.get("build_inputs")
    config = values_of(best["config"])
    for fmt, artifact in artifacts.items():
        artifact["batch_size"] = config.batch_size
        runtime = of_format(fmt)
        if runtime is not None:  # the settings its runtime loads it with (an ONNX graph's session's)
            artifact.update(runtime.load_settings(config, env.device))
    return artifacts
