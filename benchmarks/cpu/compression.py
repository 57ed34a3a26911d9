"""Compression settings side by side: what pruning and int8 do to speed, size, MACs and accuracy.

    python -m benchmarks.cpu.compression            # about 2 minutes on 2 idle CPU cores, training included
    python -m benchmarks.cpu.compression --quick    # smoke test: lstm, baseline and two settings
    python -m benchmarks.cpu.compression --workloads transformer,lstm   # a subset
    python -m benchmarks.cpu.compression --out DIR  # also write DIR/compression.json

One table per workload of benchmarks/cpu/workloads.py (the digits CNN, a transformer encoder, an
LSTM). Each row is one trial of the tuner's own harness (autotune.trial.inference.TrialContext, here in
this process): build the setting on the baseline, time it end to end, run the accuracy guard.
The speed ratio of a setting is to the baseline measured just before and just after it (the
mean of the two); the title says how far those baseline measurements spread by themselves.

MACs are autotune's own count (torch's FlopCounterMode, after pruning), so int8 never changes
them. Nothing here asserts a speed; a ratio inside the baseline's own spread is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.core import OthersCPU, machine, table, workload, workloads

MAX_METRIC_DROP = 0.01  # the guard's default: one point of accuracy
# This benchmark's own timing, the same for every workload it runs (not theirs: it times settings).
MEASURE = {"n_windows": 3, "window_s": 0.3, "warmup_batches": 3}
QUICK_MEASURE = {"n_windows": 2, "window_s": 0.1, "warmup_batches": 2}
# The names this benchmark has always taken and printed, for workloads registered under another.
ALIASES = {"transformer": "transformer-small"}
FINETUNE_STEPS = 200

# (name, changes to the baseline config). Fine-tuning rows need the workload's loss_fn.
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("baseline", {}),
    ("structured 0.3", {"prune_ratio": 0.3}),
    ("structured 0.3 + finetune", {"prune_ratio": 0.3, "finetune_steps": FINETUNE_STEPS}),
    ("structured 0.5", {"prune_ratio": 0.5}),
    ("structured 0.5 + finetune", {"prune_ratio": 0.5, "finetune_steps": FINETUNE_STEPS}),
    ("unstructured 0.5", {"prune_ratio": 0.5, "prune_method": "unstructured"}),
    ("int8_dynamic", {"quantization": "int8_dynamic"}),
    ("int8_static (eager)", {"quantization": "int8_static"}),
    # For reference: how much of int8_static + compile is the compiler alone.
    ("compile (float32)", {"compile_mode": "default"}),
    ("int8_static + compile", {"quantization": "int8_static", "compile_mode": "default"}),
    # Per-layer fallback: the fewest most sensitive layers float that keep the guard.
    ("int8_dynamic + fallback auto", {"quantization": "int8_dynamic", "int8_fallback": "auto"}),
    (
        "int8_static + fallback auto + compile",
        {"quantization": "int8_static", "int8_fallback": "auto", "compile_mode": "default"},
    ),
    (
        "structured 0.3 + finetune + int8_dynamic",
        {"prune_ratio": 0.3, "finetune_steps": FINETUNE_STEPS, "quantization": "int8_dynamic"},
    ),
]
QUICK_SETTINGS = ("baseline", "structured 0.3", "int8_dynamic")


def names() -> list[str]:
    """The workloads it runs when not told which (those registered for it), by the names it takes."""
    shown = {registered: name for name, registered in ALIASES.items()}
    return [shown.get(w.name, w.name) for w in workloads(benchmark="cpu.compression")]


def context(cfg: dict[str, Any], measure: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The tuner's trial harness for one workload, and its baseline config (``shrink`` preset)."""
    import autotune
    from autotune.data import validation_indices
    from autotune.trial.inference import TrialContext
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.spec import WorkerSpec

    model, dataset, loss_fn = cfg["model"], cfg["dataset"], cfg.get("loss_fn")
    baseline = autotune.plan(model, dataset, space="shrink", device="cpu", loss_fn=loss_fn)[2].baseline
    spec = WorkerSpec(
        model=model,
        dataset=dataset,
        metric=cfg.get("metric"),
        device="cpu",
        baseline=baseline,
        val_indices=validation_indices(len(dataset), 512),  # optimize()'s default n_val
        measure=MeasureSettings(**measure),
        loss_fn=loss_fn,
        train_dataset=cfg.get("train_dataset"),
        test_dataset=cfg.get("test_dataset"),
    )
    return TrialContext(spec), baseline


def run_workload(name: str, settings: list[tuple[str, dict]], measure: dict[str, Any]) -> dict[str, Any]:
    """Every setting as one trial on ``name``, each followed by a re-measurement of the baseline.

    Other processes come and go on a shared machine, and a 2-thread baseline can run at half speed
    for a minute; a ratio to the baseline measured just before and just after a setting cancels
    what changed slower than that.
    """
    from autotune.trial.measure import measure as time_it

    started = time.perf_counter()
    cfg = workload(ALIASES.get(name, name)).build()
    ctx, baseline = context(cfg, measure)
    base_state = ctx.build(baseline)  # built once: its re-measurements are timing only
    others = OthersCPU()
    rows, before = [], None
    for label, changes in settings:
        if changes.get("finetune_steps") and cfg.get("loss_fn") is None:
            rows.append({"setting": label, "changes": changes, "status": "skipped", "reason": "needs loss_fn"})
            continue
        row = {"setting": label, "changes": changes, **ctx.run_trial({**baseline, **changes}).to_attrs()}
        if row["status"] == "ok":
            after = time_it(base_state, ctx.spec.dataset, ctx.spec.measure)["samples_per_s"]
            before = before or row["samples_per_s"]  # the first row is the baseline itself
            row.update(
                baseline_before=before, baseline_after=after, speedup=2 * row["samples_per_s"] / (before + after)
            )
            before = after
        row["others_cores"] = others()
        rows.append(row)
        print(f"  {name}: {label:<42} {row['status']:<10} {row['trial_s']:5.1f} s", flush=True)
    if rows[0]["setting"] != "baseline" or rows[0]["status"] != "ok":
        raise RuntimeError(f"{name}: the baseline trial failed: {rows[0].get('reason')}")
    return {
        "workload": name,
        "baseline_config": baseline,
        "baseline_metric": ctx.info["baseline_metric"],
        "n_val": ctx.info["n_val"],
        "n_params": ctx.info["n_params"],
        "baseline_samples_per_s": [rows[0]["samples_per_s"]] + [r["baseline_after"] for r in rows if "speedup" in r],
        "rows": rows,
        "wall_s": time.perf_counter() - started,
    }


def _ratio(value: Any, reference: Any) -> str:
    return f"{value / reference:.2f}x" if value is not None and reference else "-"


def _cells(row: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    if row["status"] != "ok":
        reason = row["reason"] if len(row["reason"]) <= 40 else row["reason"][:37] + "..."
        return [row["setting"], f"{row['status']}: {reason}", *["-"] * 7, f"{row.get('trial_s', 0.0):.1f}", ""]
    drop = row["metric_drop"]
    return [
        row["setting"],
        "ok",
        f"{row['samples_per_s']:,.0f}",
        f"{row['speedup']:.2f}x",
        _ratio(row["size_bytes"], ref["size_bytes"]),
        _ratio(row["size_bytes_compressed"], ref["size_bytes_compressed"]),
        _ratio(row.get("macs"), ref.get("macs")),
        f"{drop:+.4f}",
        "pass" if drop <= MAX_METRIC_DROP else "FAIL",
        f"{row['trial_s']:.1f}",
        f"{row['others_cores']:.2f}",
    ]


def print_workload(w: dict[str, Any]) -> None:
    ref = w["rows"][0]
    base = w["baseline_samples_per_s"]
    median = statistics.median(base)
    title = (
        f"{w['workload']}: {w['n_params']:,} parameters, {ref['size_bytes'] / 1024:,.0f} KiB "
        f"({ref['size_bytes_compressed'] / 1024:,.0f} KiB compressed), {ref['macs']:,} MACs per sample, "
        f"accuracy {w['baseline_metric']:.4f} on {w['n_val']} samples; baseline measured {len(base)} times: "
        f"{median:,.0f} samples/s median, {min(base) / median:.2f}-{max(base) / median:.2f}x of it; {w['wall_s']:.0f} s"
    )
    table(
        title,
        "setting|status|samples/s|samples/s (x)|size (x)|compressed (x)|MACs (x)|"
        f"metric drop|guard (<= {MAX_METRIC_DROP:g})|trial s|others' cores",
        [_cells(r, ref) for r in w["rows"]],
    )
    notes = [f"- {r['setting']}: {r['status']}: {r['reason']}" for r in w["rows"] if r["status"] != "ok"]
    if notes:
        print("\n".join(notes) + "\n", flush=True)


def main(argv: list[str] | None = None) -> None:
    known = names()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu.compression", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: lstm, baseline and two settings")
    parser.add_argument(
        "--workloads", help=f"comma-separated, from {', '.join(known)} (default: all; lstm with --quick)"
    )
    parser.add_argument("--out", type=Path, help="directory for compression.json (default: a temp dir)")
    args = parser.parse_args(argv)
    chosen = (args.workloads or ("lstm" if args.quick else ",".join(known))).split(",")
    unknown = [n for n in chosen if n not in known]
    if unknown:
        parser.error(f"No workload named {unknown[0]!r}. Known: {', '.join(known)}.")
    out = args.out or Path(tempfile.mkdtemp(prefix="autotune-compression-"))
    out.mkdir(parents=True, exist_ok=True)

    info = machine()
    v = info["versions"]
    print(
        f"autotune compression benchmark, {info['date']}, {'quick' if args.quick else 'full'}\n"
        f"{info['device']}: {info['cpu']}, {info['cpu_count']} cores, {info['cpu_capability']}, "
        f"{info['mem_gib']} GiB; python {v['python']}, torch {v['torch']}\n"
        f"load average (1 min): {os.getloadavg()[0]:.2f}; 'others' cores' = CPU used by other processes",
        flush=True,
    )
    if args.quick:
        settings, measure = [s for s in SETTINGS if s[0] in QUICK_SETTINGS], QUICK_MEASURE
    else:
        settings, measure = SETTINGS, MEASURE
    results = []
    for name in chosen:
        results.append(run_workload(name, settings, measure))
        print_workload(results[-1])
    doc = {"machine": info, "quick": args.quick, "measure": measure, "max_metric_drop": MAX_METRIC_DROP}
    (out / "compression.json").write_text(json.dumps({**doc, "workloads": results}, indent=2, default=str) + "\n")
    print(f"wrote {out / 'compression.json'}")


if __name__ == "__main__":
    main()
