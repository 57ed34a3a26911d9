"""Training across processes on this machine: ``world_size`` in {1, 2} tuned like any knob.

    python -m benchmarks.ddp [--trials 8] [--rounds 3] [--out DIR]

For a small real model on real data (scikit-learn's digits: an MLP and a small CNN, the
``digits-mlp`` and ``digits-cnn`` workloads of benchmarks/cpu/workloads.py), from freshly
initialised weights, at a fixed global effective batch of 64:

1. ``autotune.optimize(mode="train", space="default")``: the search may run a trial in two ranks
   (torchrun, gloo, each rank on half of the cores) with DDP's knobs.
2. One training worker then runs the baseline, the single-process expert recipe (fused AdamW;
   bf16 where the CPU has bf16 units) and the winner side by side, :data:`N_ROUNDS` rounds each
   in turn (a distributed configuration's ranks launched for every round). The table gives
   samples/s (global), the final loss of each, and the winner's DDP knobs.

Nothing is asserted; the table is printed and written to ``OUT/ddp.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.core import start_worker, workload, workloads

N_ROUNDS = 3
EFFECTIVE = 64
OPTIMIZER = (torch.optim.AdamW, {"lr": 1e-3})


def expert(env: Any) -> dict[str, Any]:
    """The single-process recipe an expert writes on this CPU."""
    return {"optimizer_impl": "fused", **({"amp_dtype": "bfloat16"} if env.bf16 else {})}


def run_workload(name: str, out: Path, n_trials: int, n_rounds: int) -> dict[str, Any]:
    import shutil

    import autotune

    cfg = workload(name).build()  # the model is a class: each trial builds it, seeded
    data, model, loss_fn = cfg["dataset"], cfg["model"], cfg["loss_fn"]
    shutil.rmtree(out / name, ignore_errors=True)  # an earlier run's study would refuse to start again
    started = time.perf_counter()
    result = autotune.optimize(model, data, mode="train", loss_fn=loss_fn, optimizer=OPTIMIZER,
                               effective_batch_size=EFFECTIVE, baseline_batch_size=EFFECTIVE, space="default",
                               n_trials=n_trials, out_dir=out / name, export=(), profile=False)  # fmt: skip
    search_s = time.perf_counter() - started
    train = {"optimizer": OPTIMIZER, "effective_batch_size": EFFECTIVE}
    runner, space, env = start_worker(cfg, out, f"ddp-{name}", train=train)
    base = dict(space.baseline)
    rows = {"baseline": base, "expert (1 process)": {**base, **expert(env)}, "autotune": dict(result.best_config)}
    rows["autotune"].pop("rebuild", None)
    ranked = [t for t in result.study.trials if t.user_attrs.get("status") == "ok"
              and t.user_attrs.get("config", {}).get("world_size", 1) > 1]  # fmt: skip
    if ranked and rows["autotune"].get("world_size", 1) == 1:  # the best trial in ranks, beside the winner
        best = max(ranked, key=lambda t: t.user_attrs["samples_per_s"])
        rows["autotune's best in ranks"] = dict(best.user_attrs["config"])
    figures: dict[str, list[dict[str, Any]]] = {k: [] for k in rows}
    try:
        for i in range(n_rounds):
            k = i % len(rows)
            order = list(rows)[k:] + list(rows)[:k]
            for label in order:
                trial = runner.run(rows[label]).to_attrs()
                figures[label].append(trial)
    finally:
        runner.close()
    table = []
    for label, config in rows.items():
        ok = [t for t in figures[label] if t.get("status") == "ok"]
        rate = statistics.median(t["samples_per_s"] for t in ok) if ok else None
        table.append({"recipe": label, "samples_per_s": rate, "loss_final": ok[-1]["loss_final"] if ok else None,
                      "world_size": config.get("world_size", 1), "status": figures[label][-1].get("status"),
                      "ddp": {k: v for k, v in config.items() if k.startswith("ddp_") and config.get("world_size", 1) > 1},
                      "changes": {k: v for k, v in config.items() if base.get(k) != v}})  # fmt: skip
    return {"workload": name, "rows": table, "claimed": result.speedup, "search_s": search_s, "n_trials": n_trials}


def text(docs: list[dict[str, Any]], head: str) -> str:
    lines = [head, "", "| workload | recipe | samples/s | x baseline | final loss | ranks | DDP knobs / changes |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for doc in docs:
        base = doc["rows"][0]["samples_per_s"]
        for r in doc["rows"]:
            rate = r["samples_per_s"]
            ratio = f"{rate / base:.2f}x" if rate and base else "-"
            what = r["ddp"] or r["changes"] or "-"
            loss = f"{r['loss_final']:.4f}" if r["loss_final"] is not None else r["status"]
            lines.append(f"| {doc['workload']} | {r['recipe']} | {rate or 0:,.0f} | {ratio} | {loss} | "
                         f"{r['world_size']} | {what} |")  # fmt: skip
        lines.append(f"| {doc['workload']} | (claimed by the run) | | {doc['claimed']:.2f}x | | | "
                     f"{doc['n_trials']} trials in {doc['search_s']:.0f} s |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from autotune.env import cpu_info, usable_cpus

    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "autotune-bench-ddp")
    parser.add_argument("--trials", type=int, help="trials of each search (default: the workload's, 8)")
    parser.add_argument("--rounds", type=int, default=N_ROUNDS)
    parser.add_argument("--workloads", help="comma-separated (default: digits-mlp,digits-cnn)")
    args = parser.parse_args(argv)
    known = [w.name for w in workloads(benchmark="ddp")]
    names = args.workloads.split(",") if args.workloads else known
    if unknown := [n for n in names if n not in known]:
        parser.error(f"No workload named {unknown[0]!r}. Known: {', '.join(known)}.")
    args.out.mkdir(parents=True, exist_ok=True)
    head = f"{cpu_info().get('model', 'CPU')}, {usable_cpus()} CPUs, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    docs = [run_workload(name, args.out, args.trials or workload(name).trials("train"), args.rounds) for name in names]
    report = text(docs, head)
    (args.out / "ddp.md").write_text(report)
    print(report, flush=True)


if __name__ == "__main__":
    main()
