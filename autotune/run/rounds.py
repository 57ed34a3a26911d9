"""The rounds at the end of a search: the finalists timed against each other (the selection),
the pick re-measured against the baseline (the confirmation), and the claim.

:mod:`autotune.run.claims` judges the rounds; :mod:`autotune.run.output` writes the result files.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from autotune.errors import InputError

__all__ = ["baseline_and_best", "claim_speedup", "confirm", "select"]


# Seconds of confirmation rounds a run without a timeout gives its pick, besides the workers'
# starts and builds (see confirm's builds_free).
CONFIRM_S = 90.0
# Seconds of selection rounds a run without a timeout gives its finalists, besides the builds
# (two rounds at least): the finalists are within a few % of each other (see
# autotune.search.select.FINALIST_SHARE), and the claim comes from the confirmation. Five
# rounds of three compiled MiniLM finalists and the baseline took 225 s of a 469-s finish.
SELECT_S = 45.0
# Without a time limit, a run's finish (the rounds, the workers' starts and builds, the export,
# the reports) is planned to take at most this share of the whole run: the selection and
# confirmation rounds have what its predicted other costs leave of it, ROUNDS_FLOOR_S at least
# and SELECT_S + CONFIRM_S at most (the least rounds a claim is made from are run whatever the
# plan). Rounds of a quarter of the run before them, besides those costs, made the finish 35% of
# a 16-trial real-MiniLM run (59 s of confirmation and 18 s of export after a 146-s search).
FINISH_SHARE = 0.25
ROUNDS_FLOOR_S = 10.0
# Timed windows per finalist in a selection round: one, as in a confirmation round
# (:data:`autotune.trial.inference.ROUND_WINDOWS`). The selection only chooses, among finalists
# within a few % of each other: a real MiniLM pick's second window was 1.8 s of a two-finalist
# selection.
SELECT_WINDOWS = 1
# A finalist displaces the fastest trial only by running this much faster than it in the
# selection rounds: the finalists are within a few % of each other, and two rounds of one window
# do not tell them apart (real text: OpenVINO bf16 at a batch of 64 was picked over 32 at 1.007
# of it, 0.95 and 1.06 in its two rounds; re-timed, 32 ran 6% faster). The trials' own windows
# ranked the fastest trial first.
SELECT_GAIN = 1.03


def baseline_and_best(study: Any, objectives: Sequence[str], select: Any, required: bool = True) -> Any:
    from autotune.record import trial_record
    from autotune.search.select import choose

    records = [trial_record(t) for t in study.get_trials(deepcopy=False)]
    baseline = next((r for r in records if r.get("baseline") and r.get("status") == "ok"), None)
    if baseline is None:
        if required:
            raise InputError("The baseline was never measured successfully; see trials.csv for why.")
        return None
    return baseline, choose(records, objectives, select) or baseline


def _figures(rounds: list[list[dict[str, Any]]], i: int) -> dict[str, Any]:
    """Configuration ``i``'s figures over rounds: throughput as the geometric mean (so that the
    ratio of two configurations' figures is the claimed speedup), the rest as medians."""
    from autotune.trial.intervals import geomean

    col = [r[i] for r in rounds]
    out: dict[str, Any] = {"samples_per_s": geomean([c["samples_per_s"] for c in col])}
    for key in ("latency_ms_p50", "latency_ms_p95"):
        if all(key in c for c in col):
            out[key] = statistics.median(c[key] for c in col)
    for key in ("loader_samples_per_s", "model_samples_per_s"):  # timed in each process's first round
        if any(key in c for c in col):
            out[key] = statistics.median(c[key] for c in col if key in c)
    out["others_cpu"] = statistics.fmean(c.get("others_cpu", 0.0) for c in col)
    return out


def _rounds(
    runner: Any, configs: list[dict[str, Any]], n_min: int, n_max: int, **kw: Any
) -> list[list[dict[str, Any]]]:
    return _rounds_reply(runner, configs, n_min, n_max, **kw)["rounds"]


def _rounds_reply(runner: Any, configs: list[dict[str, Any]], n_min: int, n_max: int, **kw: Any) -> dict[str, Any]:
    import math

    # The worker begins no round it cannot end before the run's deadline, where the runner would
    # stop waiting and the rounds timed so far would be lost with it (a reply takes a moment).
    # Counted from after the worker's start: a search's last trial killed at its deadline left
    # none, and the quickstart's rounds, told 6.5 s before a new worker took some of them, were
    # killed with nothing timed.
    runner.ensure()
    left = runner.bounded(math.inf) if getattr(runner, "deadline", None) is not None else None
    until_s = None if left is None else max(0.0, 0.98 * left - 0.2)
    # Each round is at most one trial's work per configuration.
    return runner.call("rounds", configs, n_min, n_max, kw.get("target"), kw.get("max_s"), kw.get("diagnose", False),
                       kw.get("drawn", 0), until_s, kw.get("builds_free", False), kw.get("windows", 0),
                       kw.get("window_s", 0.0), n_trials=len(configs) * n_max)  # fmt: skip


def select(
    runner: Any, finalists: list[dict[str, Any]], n_rounds: int, max_s: float | None = None, builds_free: bool = False
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Pick one finalist on interleaved selection rounds of the finalists alone (``n_rounds``,
    or as many as fit in ``max_s`` seconds, two at least; with ``builds_free``, seconds of
    rounds, the builds not counted): each finalist's ratio is to the first
    (the fastest trial) in the same round, and the first stays the pick unless another's
    ratio is :data:`SELECT_GAIN` or more. The baseline is not timed: the claim against it
    comes from the confirmation, and its rounds of the slow baseline of real MiniLM were a
    third of each selection round.

    Returns:
        (the pick, the finalists' table: each ``ratio`` to the first finalist, its trial number
        in ``against``). With one finalist nothing needs choosing: no rounds are run.
    """
    from autotune.trial.intervals import interval

    if len(finalists) == 1:
        return finalists[0], [{"trial": finalists[0]["number"], "selection": "the only finalist"}]
    n_min = n_rounds if max_s is None else min(2, n_rounds)
    rounds = _rounds(runner, [f["config"] for f in finalists], n_min, n_rounds, max_s=max_s, builds_free=builds_free,
                     windows=SELECT_WINDOWS)  # fmt: skip
    table = []
    for i, f in enumerate(finalists):
        ratios = [r[i]["samples_per_s"] / r[0]["samples_per_s"] for r in rounds]
        mid, lo, hi = interval(ratios)
        table.append({"trial": f["number"], "against": finalists[0]["number"], "ratio": mid, "low": lo, "high": hi,
                      "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                      "n_rounds": len(ratios)})  # fmt: skip
    pick = max(range(len(finalists)), key=lambda k: table[k]["ratio"])
    if table[pick]["ratio"] < SELECT_GAIN:  # within the noise of the fastest trial: it stays
        pick = 0
        table[0]["selection"] = f"the fastest trial: no finalist ran {SELECT_GAIN - 1:.0%} faster in the rounds"
    table[pick]["picked"] = True
    return finalists[pick], table


def confirm(
    runner: Any,
    baseline: dict[str, Any],
    pick: dict[str, Any],
    settings: Any,
    *,
    n_min: int = 5,
    n_max: int = 15,
    target: float | None = None,
    max_s: float = CONFIRM_S,
    diagnose: bool = True,
    n_processes: int | None = None,
    fresh: bool = True,
    builds_free: bool = False,
    ready: bool = False,
    window_s: float = 0.0,
) -> dict[str, Any]:
    """Fresh interleaved rounds of the baseline and the pick alone: the claim, over
    ``n_processes`` fresh worker processes (default :data:`~autotune.run.claims.CONFIRM_PROCESSES`).

    Rounds continue until the ratio's 95% interval is within +-``target`` or ``n_max`` rounds
    (or ``max_s`` seconds) are spent. With ``diagnose``, the loader alone and the model alone are
    timed in the first process's first round. With ``builds_free`` (a run without a time limit),
    ``max_s`` counts the rounds, not the workers' starts and builds. With ``ready``, the
    runner's worker is a fresh one already (the selection's): the first process's rounds run
    in it, on the builds its selection rounds made. ``window_s``: each timed window's seconds
    (0: the timing settings'; see :func:`round_window`).

    Returns:
        ``{"claim": judge(...), "baseline": figures, "best": figures, "rounds": n}``, see
        :func:`autotune.run.claims.judge`.
    """
    from autotune.run.claims import CONFIRM_DRAWS, CONFIRM_PROCESSES, TARGET_HALF_WIDTH, judge, shortfall
    from autotune.trial.intervals import geomean

    target = TARGET_HALF_WIDTH if target is None else target
    groups, pids, why = _process_rounds(runner, [baseline["config"], pick["config"]], n_min, n_max,
                                        n_processes or CONFIRM_PROCESSES, fresh=fresh, builds_free=builds_free,
                                        target=target, max_s=max_s, diagnose=diagnose, drawn=CONFIRM_DRAWS,
                                        ready=ready, window_s=window_s)  # fmt: skip
    rounds = [r for g in groups for r in g]
    ratios = [r[1]["samples_per_s"] / r[0]["samples_per_s"] for r in rounds]
    processes = [geomean([r[1]["samples_per_s"] / r[0]["samples_per_s"] for r in g]) for g in groups]
    base, best = _figures(rounds, 0), _figures(rounds, 1)
    others = statistics.fmean([base["others_cpu"], best["others_cpu"]])
    short = shortfall(ratios, len(groups), why, n_max, target, max_s)
    claim = judge(ratios, others, settings.max_others_cpu, processes=processes if len(groups) > 1 else (),
                  shortfall=short)  # fmt: skip
    claim["n_processes"] = len(groups)
    # Every round's own figures, kept with the claim: a claim that a user's re-time does not
    # reach is read round by round (which side moved, in which process) from the files alone.
    claim["rounds"] = [
        {"process": k, "baseline_samples_per_s": round(r[0]["samples_per_s"], 2),
         "pick_samples_per_s": round(r[1]["samples_per_s"], 2)}
        for k, g in enumerate(groups) for r in g
    ]  # fmt: skip
    # A shape compiled, or run eager past dynamo's limit, inside the rounds' windows: said, not hidden.
    claim["recompiles"] = sum(r[i].get("recompiles", 0) for r in rounds for i in (0, 1))
    claim["compile_fallbacks"] = max((r[1].get("compile_fallbacks", 0) for r in rounds), default=0)
    if claim["compile_fallbacks"]:
        claim["sentence"] += (
            "; the pick ran batches of some shapes eager (torch.compile reached dynamo's recompile limit), "
            "as it will in use"
        )
    if claim["recompiles"]:
        claim["sentence"] += f"; {claim['recompiles']} compile(s) fell inside the rounds' timed windows"
    return {"claim": claim, "baseline": base, "best": best, "worker_pids": pids}


def _process_rounds(
    runner: Any, configs: list[dict[str, Any]], n_min: int, n_max: int, n_processes: int, **kw: Any
) -> tuple[list[list[list[dict[str, Any]]]], list[int | None], str | None]:
    """Interleaved rounds split over up to ``n_processes`` worker processes, a fresh one each
    (where the runner can start one): each process's rounds (at least two each), its pid, and
    why fewer processes ran than ``n_processes`` (``None`` when none is missing).

    The first process is fresh too, not the worker that ran the trials, which carries what
    every trial left in it (in one real-text run it gave the pick 5.45x, a fresh worker 6.51x
    and the user's own fresh processes 6.58x): a user's process is a fresh one. The first
    process gets its share of ``max_s``; a later one starts only while at least half a share is
    left, so a run's timeout still bounds the claim."""
    import math

    from autotune.errors import TrialError

    max_s = kw.pop("max_s", None)
    # With builds_free, max_s is the rounds' time: what each process spent starting and building
    # is not counted (a compiled pick's builds took most of a 167-s confirmation: 3 rounds, 1 process).
    builds_free = kw.get("builds_free", False)
    why = None if runner.restarts else "isolation='inprocess' starts no worker process"
    fresh, ready = kw.pop("fresh", True), kw.pop("ready", False)
    if not fresh and runner.restarts:
        # A budget with no room for a fresh worker's start (a real MiniLM worker's took most of
        # a 3-minute budget's 60-s confirmation): the search's own worker times the rounds.
        why = "the budget left no time to start a fresh worker: the search's worker timed them"
    n_processes = n_processes if runner.restarts else 1
    # The loader and the model alone explain the claim: timed in the first process's first round
    # only (in each process's, they took 10 s a configuration of a second process's rounds).
    diagnose = kw.pop("diagnose", False)
    # Confirmation rounds draw from a range of their own: a fresh process counts rounds from
    # zero, and would otherwise re-read the batches the selection rounds drew.
    started, groups, pids, drawn = time.monotonic(), [], [], kw.pop("drawn", 0)
    unpaid = 0.0  # starts and builds, where max_s does not count them

    def left_s() -> float | None:
        return None if max_s is None else max_s - (time.monotonic() - started - unpaid)

    for k in range(n_processes):
        if k:
            left, owed = left_s(), builds_free and sum(len(g) for g in groups) < n_min
            # Without a deadline (builds_free), the least rounds are run in every process whatever
            # their time: at 20 s, a claim came from 3 rounds in 1 process.
            if left is not None and not owed and left / (n_processes - k) < 0.5 * max_s / n_processes:
                # Too little time left for another process's rounds (its start and builds too).
                why = f"{max(left, 0.0):.3g} s of the confirmation's {max_s:.3g} s were left, too little for another"
                break
        try:
            # Each process is a fresh one, but the first where the budget left no time to start it.
            begun = time.monotonic()
            if k:
                restarted = runner.restart()  # the spare the first one started, where it did
            else:  # a fresh one starts a spare beside it for the next process's rounds
                restarted = runner.restart(spare=n_processes > 1) if fresh and not ready else True
            if not restarted and k:
                why = "a fresh worker process could not be started"
                break
            unpaid += time.monotonic() - begun if builds_free else 0.0
            # The share is what is left after the new process started: its start counts too.
            left = left_s()
            share = None if left is None else max(left, 0.0) / (n_processes - k)
            # The least rounds still owed, over the processes still to run (two each at least):
            # at ceil(5 / 2) each, five asked for were six, a round of the slow baseline more.
            done = sum(len(g) for g in groups)
            n_lo = max(2, math.ceil((n_min - done) / (n_processes - k)))
            n_hi = max(n_lo, math.ceil(n_max / n_processes))
            # Each process draws batches after the earlier ones': no round re-reads another's.
            reply = _rounds_reply(runner, configs, n_lo, n_hi, max_s=share, drawn=drawn, diagnose=diagnose and not k,
                                  **kw)  # fmt: skip
        except TrialError as exc:
            if not k or exc.kind != "deadline":
                raise
            # The run's deadline cut a later process short: the earlier one's rounds stand.
            why = f"the run's deadline cut the next process short ({exc})"
            break
        groups.append(reply["rounds"])
        pids.append(reply.get("pid"))
        unpaid += float(reply.get("built_s") or 0.0) if builds_free else 0.0
        drawn = reply.get("drawn", drawn)
    return groups, pids, why


def rounds_s(spent_s: float | None, other_s: float = 0.0) -> tuple[float, float]:
    """Seconds of selection rounds and of confirmation rounds (builds not counted) that a run
    without a time limit gives its finalists and its pick, after ``spent_s`` seconds of
    preparing and searching, when the rest of its finish is predicted to take ``other_s``
    seconds: what keeps the whole finish within :data:`FINISH_SHARE` of the run, split as
    :data:`SELECT_S` and :data:`CONFIRM_S` are (those with ``None``). Where the rest of the
    finish leaves less than :data:`ROUNDS_FLOOR_S`, the selection gets none: it runs its least
    rounds (two), as the confirmation does, on a finish already at its share (a real MiniLM
    selection's 3.3 s at the floor were four rounds where two decided it).

    Example:
        >>> rounds_s(None), rounds_s(1000.0)
        ((45.0, 90.0), (45.0, 90.0))
        >>> rounds_s(180.0), rounds_s(180.0, other_s=40.0)
        ((20.0, 40.0), (6.666666666666667, 13.333333333333334))
        >>> rounds_s(146.0, other_s=42.0)  # the floor: the least rounds run anyway
        (0.0, 6.666666666666667)
    """
    if spent_s is None:
        return SELECT_S, CONFIRM_S
    plan = spent_s * FINISH_SHARE / (1.0 - FINISH_SHARE) - other_s
    total = min(SELECT_S + CONFIRM_S, max(ROUNDS_FLOOR_S, plan))
    confirm_s = CONFIRM_S * total / (SELECT_S + CONFIRM_S)
    return (SELECT_S * total / (SELECT_S + CONFIRM_S) if plan >= ROUNDS_FLOOR_S else 0.0), confirm_s


def _affordable(
    finalists: list[dict[str, Any]], budget_s: float | None, need_s: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The finalists a budget of ``budget_s`` seconds selects among, and a table row for each
    left out: where two selection rounds and the least confirmation (``need_s``) do not both
    fit, the fastest trial is confirmed alone. A 3-minute budget's selection took 50 of its
    61 s, and the confirmation was killed with nothing timed."""
    from autotune.search.cost import selection_s

    if budget_s is None or len(finalists) < 2 or budget_s >= need_s + selection_s(finalists):
        return finalists, []
    why = (f"the budget's {budget_s:.0f} s held the confirmation ({need_s:.0f} s) but not selection rounds too: "
           "the fastest trial was confirmed")  # fmt: skip
    return finalists[:1], [{"trial": f["number"], "not_selected": why} for f in finalists[1:]]


# A confirmation round's window holds at least this many of the baseline's batches, and lasts
# at least ROUND_WINDOW_MIN_S: a fast model's rounds are short and many, a slow one's keep the
# timing settings' windows. The quickstart's MLP (an epoch in 22 ms) timed 5 rounds of 0.4-s
# windows in 10 s, one of them at 0.65x, and could not tell its 1.75x pick from 1.0.
ROUND_WINDOW_BATCHES = 40
ROUND_WINDOW_MIN_S = 0.1


def round_window(baseline: dict[str, Any], settings: Any) -> tuple[float, int]:
    """Seconds of a confirmation round's windows, sized to the baseline's batches (at most the
    timing settings' ``window_s``), and how many times more rounds that many seconds hold.

    Example:
        >>> from types import SimpleNamespace
        >>> settings = SimpleNamespace(window_s=0.4)
        >>> round_window({"samples_per_s": 180_000.0, "config": dict(batch_size=32)}, settings)  # a small MLP
        (0.1, 4)
        >>> round_window({"samples_per_s": 100.0, "config": dict(batch_size=32)}, settings)  # real text
        (0.4, 1)
    """
    sps, batch = baseline.get("samples_per_s"), (baseline.get("config") or {}).get("batch_size")
    if not sps or not batch:
        return settings.window_s, 1
    window = min(settings.window_s, max(ROUND_WINDOW_MIN_S, ROUND_WINDOW_BATCHES * batch / sps))
    return window, max(1, int(settings.window_s / window))


def claim_speedup(
    runner: Any,
    baseline: dict[str, Any],
    finalists: list[dict[str, Any]],
    n_rounds: int,
    speed_only: bool,
    settings: Any,
    diagnose: bool = True,
    budget_s: float | None = None,
    need_s: float = 0.0,
    spent_s: float | None = None,
    other_s: float = 0.0,
) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    """Select among the finalists, then confirm the pick on fresh rounds; with ``budget_s``
    (a study with a timeout), the selection leaves the least confirmation's predicted cost
    (``need_s``), or half the budget, and the confirmation has what the selection left; where
    both do not fit, the fastest trial is confirmed without a selection (:func:`_affordable`).
    A ``budget_s`` under ``need_s`` runs nothing: the claim is then "unconfirmed: deadline", as
    it is when the deadline cuts the rounds off. Without ``budget_s``, the rounds take what keeps
    the finish within a share of the run, after the ``spent_s`` seconds the run took before them
    and the ``other_s`` seconds the rest of the finish is predicted to take (:func:`rounds_s`).

    Returns:
        (the winner's record, the confirmation (see :func:`confirm`) or ``None`` when
        nothing was confirmed, the finalists' table). When speed is the only objective, the
        baseline stands if the confirmation finds no measurable speedup, finds the pick slower
        (``slower``), or ran beside busy processes (``noisy``); with other objectives (size,
        say) a slower winner can still be the right one (verdict ``slower``).
        A measurement that fails in the worker leaves the search's best trial, and the table
        holds ``{"error": message, "failed": True}``: the claim is that failure (verdict ``failed``).
    """
    from autotune.errors import TrialError

    if budget_s is not None and budget_s < max(need_s, 2.0):  # too little left to confirm anything
        left = f"{budget_s:.0f} s were left before the run's deadline"
        return finalists[0], None, [{"error": f"{left}, and confirming the pick needs about {need_s:.0f} s",
                                     "deadline": True}]  # fmt: skip
    started = time.monotonic()
    finalists, skipped = _affordable(finalists, budget_s, need_s)
    try:
        # Selection and confirmation share the budget; with one finalist nothing is selected.
        half = None if budget_s is None else max(budget_s - need_s, budget_s / 2) if len(finalists) > 1 else budget_s
        select_max, confirm_max = rounds_s(spent_s, other_s)
        # Without a deadline the selection runs in a fresh worker, the confirmation's first process:
        # its builds are timed again, not rebuilt (a compiled pick's build and warm-up took 8-9 s).
        ready = half is None and len(finalists) > 1 and bool(runner.restarts) and runner.restart(spare=True)
        # Without a deadline the rounds' seconds are counted, not the builds': priced from the
        # trials' cold compiles (23 s), a build from the cache (8 s) left time for 4 rounds, not 2.
        pick, table = select(runner, finalists, n_rounds, max_s=select_max if half is None else half,
                             builds_free=half is None)  # fmt: skip
        table = [*table, *skipped]
        if budget_s is not None:  # the confirmation has what the selection left
            half = max(0.0, budget_s - (time.monotonic() - started))
        # A budget that holds the least confirmation (and a worker's start) once but not twice
        # confirms in one process: split in two, a 3-minute budget's first process had 8 s for
        # its rounds, and none ended.
        # Its rounds are the least a claim is made from (two), without the loader and the model
        # timed apart: with them, 3 rounds of real MiniLM outran a 60-s confirmation and none came back.
        one = half is not None and half < 2 * (need_s + float(getattr(runner, "start_s", None) or 0.0))
        n_min = n_rounds if half is None else min(2 if one else 3, n_rounds)
        diagnose = diagnose and not one
        window_s, more = round_window(baseline, settings)
        confirmed = confirm(runner, baseline, pick, settings, n_min=n_min, n_max=3 * n_rounds * more,
                            diagnose=diagnose, max_s=confirm_max if half is None else half, builds_free=half is None,
                            n_processes=1 if one else None, fresh=not one, ready=bool(ready),
                            window_s=window_s)  # fmt: skip
    except TrialError as exc:  # the study stands; the claim is this failure, with its message
        if exc.kind == "deadline":  # cut off by the run's deadline: unconfirmed, not failed
            return finalists[0], None, [{"error": str(exc), "deadline": True}]
        return finalists[0], None, [{"error": str(exc), "failed": True}]
    if speed_only and confirmed["claim"]["verdict"] in ("none", "noisy", "slower"):
        # Nothing measurable, measurably slower, or measured beside busy processes: a pick made
        # under load (one thread, say) can be slower on a quiet machine, so the model as given stands.
        confirmed["kept_baseline"] = pick["number"]
        return baseline, confirmed, table
    return pick, confirmed, table
