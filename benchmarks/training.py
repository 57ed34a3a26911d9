"""Training-step throughput: the tuner's winner (``mode="train"``) against the baseline and an
expert's hand-written training recipe, measured interleaved by one trial worker.

For one workload (a dict as a cfg.py defines, with ``loss_fn``):

1. ``autotune.optimize(mode="train")`` with a fixed budget, from freshly initialised weights:
   the tuner's winner.
2. A fresh training worker, started with the spec ``optimize`` sends, runs the expert recipe as
   an ordinary training trial (the loss-curve guard included); a rejected recipe falls back to
   the next one, and the table says why.
3. The same worker trains baseline, winner and expert from the same initial weights and times
   them interleaved, ``n_rounds`` times (``TrainContext.rounds``). Ratios are medians over rounds
   of each round's pair, with min-max.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.core import interleaved, start_worker

TRIAL_TIMEOUT_S = 600.0
OPTIMIZER = (torch.optim.AdamW, {"lr": 1e-3})


def expert_recipes(env: Any, image_input: bool) -> list[tuple[str, dict[str, Any]]]:
    """What an expert writes by hand for training, in order of preference (label, changes)."""
    if env.is_cuda:
        changes = {"amp_dtype": "bfloat16", "optimizer_impl": "fused", "compile_mode": "default"}
        if image_input:
            changes["channels_last"] = True
        return [("bf16 + fused AdamW + compile" + (" + channels_last" if image_input else ""), changes)]
    recipe = {"optimizer_impl": "fused", **({"amp_dtype": "bfloat16"} if env.bf16 else {})}
    label = "fused AdamW" + (" + bf16" if env.bf16 else "")
    return [(label, recipe), ("fused AdamW", {"optimizer_impl": "fused"})]


def from_scratch(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with freshly initialised weights (seeded): the benchmark workloads come
    trained for inference, and a training benchmark starts where training starts."""
    import copy

    torch.manual_seed(0)
    fresh = copy.deepcopy(model)
    for module in fresh.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return fresh.train()


def compare_training(
    name: str,
    cfg: dict[str, Any],
    out: Path,
    *,
    space: str,
    n_trials: int,
    n_rounds: int,
    effective_batch_size: int = 64,
    measure: dict | None = None,
) -> dict[str, Any]:
    """Tune the training step of ``cfg``, run the expert recipe, and re-measure the three."""
    import autotune

    started = time.perf_counter()
    cfg = {**cfg, "model": functools.partial(from_scratch, cfg["model"])}
    result = autotune.optimize(
        cfg["model"],
        cfg.get("train_dataset") or cfg["dataset"],
        mode="train",
        loss_fn=cfg["loss_fn"],
        optimizer=OPTIMIZER,
        effective_batch_size=effective_batch_size,
        baseline_batch_size=effective_batch_size,
        space=space,
        n_trials=n_trials,
        out_dir=out / f"train-{name}",
        measure=measure,
        n_verify_pairs=3,
        trial_timeout=TRIAL_TIMEOUT_S,
    )
    tune_s = time.perf_counter() - started
    train_cfg = {**cfg, "dataset": cfg.get("train_dataset") or cfg["dataset"], "metric": None}
    train = {"optimizer": OPTIMIZER, "effective_batch_size": effective_batch_size}
    runner, search_space, env = start_worker(train_cfg, out, f"train-{name}", measure=measure, train=train)
    baseline, tuned = search_space.baseline, result.best_config
    try:
        expert, notes = None, []
        for label, changes in expert_recipes(env, search_space.values["channels_last"] != [False]):
            trial = runner.run({**baseline, **changes}).to_attrs()
            if trial["status"] == "ok":
                expert = {
                    "label": label,
                    "config": {**baseline, **changes},
                    "loss_rel_change": trial["loss_rel_change"],
                }
                break
            notes.append(f"expert recipe '{label}' is {trial['status']}: {trial['reason']}")
            print(f"  {name}: {notes[-1]}", flush=True)
        configs = [tuned] + ([expert["config"]] if expert else [])
        print(f"  {name}: re-measuring training baseline, tuned{', expert' if expert else ''} x{n_rounds}", flush=True)
        rounds = interleaved(runner, [baseline, *configs], n_rounds)
    finally:
        runner.close()
    col = list(zip(*rounds, strict=True))
    ratios = {"tuned/baseline": [r[1] / r[0] for r in rounds]}
    if expert:
        ratios["expert/baseline"] = [r[2] / r[0] for r in rounds]
        ratios["tuned/expert"] = [r[1] / r[2] for r in rounds]
    return {
        "workload": name,
        "space": space,
        "n_trials": n_trials,
        "effective_batch_size": effective_batch_size,
        "samples_per_s": {
            k: statistics.median(v) for k, v in zip(("baseline", "tuned", "expert")[: len(col)], col, strict=True)
        },
        "rounds": rounds,
        "ratios": ratios,
        "tuned_loss_rel_change": result.best.get("loss_rel_change"),
        "tuned_changes": {k: v for k, v in tuned.items() if baseline.get(k) != v},
        "expert": expert,
        "notes": notes,
        "tune_s": tune_s,
        "wall_s": time.perf_counter() - started,
    }


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def print_training(rows: list[dict[str, Any]], unit: str = "samples/s") -> str:
    """The markdown table of :func:`compare_training` rows (printed and returned)."""
    lines = [
        f"### Training step, {unit} (effective batch kept by accumulation)",
        "",
        "| workload | baseline | tuned | expert | tuned/baseline | expert/baseline | tuned/expert | tuned loss change | tuned changes | expert recipe |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sps, ratios = r["samples_per_s"], r["ratios"]
        expert = r["expert"]
        changes = ", ".join(f"{k}={v}" for k, v in r["tuned_changes"].items()) or "(baseline)"
        change = r["tuned_loss_rel_change"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["workload"],
                    f"{sps['baseline']:,.0f}",
                    f"{sps['tuned']:,.0f}",
                    f"{sps['expert']:,.0f}" if expert else "-",
                    _ratio(ratios["tuned/baseline"]),
                    _ratio(ratios["expert/baseline"]) if expert else "-",
                    _ratio(ratios["tuned/expert"]) if expert else "-",
                    f"{change:+.2%}" if change is not None else "-",
                    changes,
                    expert["label"] if expert else "; ".join(r["notes"]),
                ]
            )
            + " |"
        )
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text
