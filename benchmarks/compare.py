"""Part 1: the tuner's winner against the baseline and an expert's hand-written recipe.

For one workload (a dict as a cfg.py defines):

1. ``autotune.optimize`` with a fixed budget (preset and number of trials): the tuner's winner.
2. A fresh trial worker, started with the spec ``optimize`` sends, runs the expert recipe as an
   ordinary trial (build, time, guard): a recipe the guard rejects, or that cannot be built,
   falls back to the next one, and the table says why.
3. The same worker re-measures baseline, winner and expert interleaved, ``n_rounds`` times
   (``TrialContext.rounds``, what ``optimize`` uses for its own speedup, order alternating). Each ratio is the
   median over rounds of that round's pair, with min-max, so drifts slower than a round cancel.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.core import OthersCPU, interleaved, spread_of, start_worker, table, trial_overheads

N_FINALIST_PAIRS = 2  # rounds of optimize's own re-measurement of its 3 finalists before it names the winner


def expert_recipes(env: Any) -> list[tuple[str, dict[str, Any]]]:
    """What an expert writes by hand, in order of preference: each entry is (label, changes to
    the baseline). The next entry is the fallback when one is infeasible."""
    if env.is_cuda:
        changes = {"batch_size": 256, "amp_dtype": "bfloat16", "channels_last": True, "compile_mode": "max-autotune"}
        return [("bf16 + channels_last + max-autotune + batch 256", changes)]
    # bf16 only where the CPU has native support or AVX-512 (the library's own rule); int8 dynamic
    # quantization of Linear/LSTM layers where the accuracy guard allows it.
    recipe = {"batch_size": 64, **({"amp_dtype": "bfloat16"} if env.bf16 else {})}
    label = "batch 64" + (" + bf16" if env.bf16 else "")
    return [(f"{label} + int8_dynamic", {**recipe, "quantization": "int8_dynamic"}), (label, recipe)]


def compare(
    name: str,
    cfg: dict[str, Any],
    out: Path,
    *,
    space: str,
    n_trials: int,
    n_rounds: int,
    measure: dict | None = None,
) -> dict[str, Any]:
    """Tune ``cfg``, run the expert recipe, and re-measure the three interleaved."""
    import autotune

    max_drop = cfg.get("max_metric_drop", 0.01)
    others, started = OthersCPU(), time.perf_counter()

    def progress(rec: dict, n_done: int, n_total: int) -> None:
        sps = f"{rec['samples_per_s']:>10,.0f} samples/s" if rec.get("samples_per_s") else ""
        print(f"  {name} trial {n_done:>2}/{n_total} {time.perf_counter() - started:5.0f} s  {rec['status']:<10} {sps}")

    result = autotune.optimize(
        cfg["model"],
        cfg["dataset"],
        metric=cfg.get("metric"),
        max_metric_drop=max_drop,
        space=space,
        n_trials=n_trials,
        out_dir=out / name,
        measure=measure,
        n_verify_pairs=N_FINALIST_PAIRS,
        trial_timeout=600.0,
        export=(),
        progress=progress,
        n_val=cfg.get("options", {}).get("n_val", 512),  # the workload's own; its other options stay unused
    )
    tune_s = time.perf_counter() - started
    runner, search_space, env = start_worker(cfg, out, f"compare-{name}", measure=measure)
    baseline, tuned = search_space.baseline, result.best_config
    try:
        expert, notes = None, []
        for label, changes in expert_recipes(env):
            trial = runner.run({**baseline, **changes}).to_attrs()
            drop = trial.get("metric_drop")
            if trial["status"] == "ok" and drop <= max_drop + 1e-12:
                expert = {"label": label, "config": {**baseline, **changes}, "metric_drop": drop}
                break
            why = trial["reason"] if trial["status"] != "ok" else f"metric drop {drop:.4f} > {max_drop:g}"
            verdict = trial["status"] if trial["status"] != "ok" else "rejected by the guard"
            notes.append(f"expert recipe '{label}' is {verdict} ({why}), so the expert falls back to the next recipe")
            print(f"  {name}: {notes[-1]}", flush=True)
        configs = [tuned] + ([expert["config"]] if expert else [])
        print(f"  {name}: re-measuring baseline, tuned{', expert' if expert else ''} interleaved x{n_rounds}")
        rounds = interleaved(runner, [baseline, *configs], n_rounds)
    finally:
        runner.close()
    col = list(zip(*rounds, strict=True))  # per config: its samples/s in every round
    ratios = {"tuned/baseline": [t / b for b, t, *_ in rounds]}
    if expert:
        ratios["expert/baseline"] = [r[2] / r[0] for r in rounds]
        ratios["tuned/expert"] = [r[1] / r[2] for r in rounds]
    return {
        "workload": name,
        "space": space,
        "n_trials": n_trials,
        "baseline_metric": result.baseline["metric"],
        "metric": "fidelity" if cfg.get("metric") is None else "user",
        "max_metric_drop": max_drop,
        "samples_per_s": {
            k: statistics.median(v) for k, v in zip(("baseline", "tuned", "expert")[: len(col)], col, strict=True)
        },
        "rounds": rounds,
        "ratios": ratios,
        "tuned_metric_drop": result.best["metric_drop"],
        "tuned_changes": {k: v for k, v in tuned.items() if baseline.get(k) != v},
        "tuner_speedup": [result.speedup, result.speedup_min, result.speedup_max],
        "tuner_claim": result.claim,
        "expert": expert,
        "notes": notes,
        "tune_s": tune_s,
        "wall_s": time.perf_counter() - started,
        "others_cores": others(),
        "trial_overheads": trial_overheads(result.study),
    }


def print_compare(rows: list[dict[str, Any]], title: str) -> str:
    def ratio(r: dict, key: str) -> str:
        return spread_of(r["ratios"][key]) if key in r["ratios"] else "-"

    cells = []
    for r in rows:
        sps, expert = r["samples_per_s"], r["expert"]
        cells.append(
            [
                r["workload"],
                f"{sps['baseline']:,.0f}",
                f"{sps['tuned']:,.0f}",
                f"{sps['expert']:,.0f}" if expert else "-",
                ratio(r, "tuned/baseline"),
                ratio(r, "expert/baseline"),
                ratio(r, "tuned/expert"),
                f"{r['tuned_metric_drop']:+.4f}",
                f"{expert['metric_drop']:+.4f}" if expert else "-",
                f"{r['tune_s']:.0f}",
                f"{r['others_cores']:.2f}",
                " ".join(f"{k}={v}" for k, v in r["tuned_changes"].items()) or "(the baseline)",
                expert["label"] if expert else "none feasible",
            ]
        )
    n_rounds = len(rows[0]["rounds"]) if rows else 0
    text = table(
        title,
        "workload|baseline samples/s|tuned samples/s|expert samples/s|tuned/baseline|expert/baseline|"
        "tuned/expert|metric drop, tuned|metric drop, expert|tuning s|others' cores|tuned config's changes|expert recipe",
        cells,
    )
    notes = [
        f"- {r['workload']}: {r['space']} preset, {r['n_trials']} trials; guard: {r['metric']} "
        f"(baseline {r['baseline_metric']:.4f}), max drop {r['max_metric_drop']:g}; "
        f"optimize's own claim: {r['tuner_claim']}"
        for r in rows
    ]
    notes += [f"- {r['workload']}: {n}" for r in rows for n in r["notes"]]
    notes.append(
        f"- samples/s: median of {n_rounds} interleaved rounds (baseline, tuned, expert) in one worker; "
        "ratios: median [min-max] of the per-round ratios."
    )
    print("\n".join(notes) + "\n", flush=True)
    return text + "\n" + "\n".join(notes) + "\n"
