"""CRAFT with its published weights on rendered document pages: baseline, the hand recipe and
autotune's winner, timed in one process.

    python -m benchmarks.vision                 # tune (16 trials), then time all three; about 30 minutes on 2 cores
    python -m benchmarks.vision --n-trials 30   # a longer search
    python -m benchmarks.vision --load OUT      # time a finished run's winner instead of tuning
    python -m benchmarks.vision --smoke         # tiny budget: checks that everything runs
    python -m benchmarks.vision --scan 12       # decode-bound: pages kept as 12x scans, decoded and scaled down per read

The workload (:mod:`benchmarks.vision.workload`): 32 pages of 168-312 pixels a side in several
aspect ratios, DejaVu faces and sizes, kept as PNG bytes; ``__getitem__`` decodes, resizes to
multiples of 32 and normalises. The metric is word-box recall (IoU >= 0.5) against the rendered
words, by CRAFT's own post-processing of its score maps. With ``--scan 12`` each page is kept as
a scan twelve times larger on each side (2,000-3,700 pixels, a 300-400-dpi scan's size) and
``__getitem__`` decodes it and scales it down to the same page: the loader, not the model, is
then the bottleneck of the baseline.

1. **baseline**: the model as given, float32, ``DataLoader(pages, batch_size=1)``: the pages
   differ in size, so without a collate of one's own a batch holds one page; no workers.
2. **hand recipe**: what a performance guide teaches for a CPU conv net: bfloat16 autocast
   where the CPU has bf16 units (AVX512-BF16 or AMX; float32 otherwise), channels-last, 2
   loader workers (persistent, prefetching) and batches of 8 pages padded by a collate written
   for it to the batch's largest size, rounded up to 32.
3. **autotune**: ``autotune.optimize(craft, pages, metric=recall, n_trials=16)`` with the default
   space and a baseline batch of 1; its winner is rebuilt with ``autotune.apply`` and
   ``autotune.dataloader``.

Each pipeline runs once to warm up (workers, compilation), then rounds in rotating order each
run it over every page. For each: pages/s (median over rounds), the ratio to the baseline (the
geometric mean of the rounds' ratios), recall, and the loader's share (the time spent waiting
for the next batch over the pass's time). Nothing here asserts a speed; time it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.core import OthersCPU, Workload, machine, ratios_to, table, workload
from benchmarks.vision import workload as vc

BASELINE_BATCH = 1
HAND_BATCH = 8
HAND_WORKERS = 2
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
# The run's own settings; the workload (``craft``) brings its pages, trials, guard samples and
# timing, which the smoke run makes smaller.
RUNS = {
    "full": {"rounds": 2},
    "smoke": {
        "n_pages": 6,
        "n_val": 4,
        "n_trials": 2,
        "rounds": 1,
        "measure": {"n_windows": 2, "window_s": 0.1, "warmup_batches": 1},
    },
}


def cpu_flags() -> list[str]:
    """The CPU features the conv recipe depends on, of those this CPU has."""
    try:
        rows = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    have = set(next((r.split(":", 1)[1].split() for r in rows if r.startswith("flags")), []))
    return [f for f in FLAGS if f in have]


def pad_collate(samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hand recipe's collate: pages padded with zeros to the batch's largest, rounded up to 32."""
    height = -(-max(x.shape[1] for x, _ in samples) // 32) * 32
    width = -(-max(x.shape[2] for x, _ in samples) // 32) * 32
    images = [torch.nn.functional.pad(x, (0, width - x.shape[2], 0, height - x.shape[1])) for x, _ in samples]
    return torch.stack(images), torch.stack([boxes for _, boxes in samples])


def timed_pass(run: Any, loader: Any, n_threads: int) -> dict[str, Any]:
    """One pass of ``run(batch) -> outputs`` over ``loader``: seconds in all, seconds waiting for
    the loader's next batch, and the recall of the outputs (scored after the clock stops)."""
    torch.set_num_threads(n_threads)
    done, wait_s = [], 0.0
    start = time.perf_counter()
    batches = iter(loader)
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        wait_s += time.perf_counter() - asked
        if batch is None:
            break
        done.append((run(batch), batch))
    total_s = time.perf_counter() - start
    n = sum(len(b[1]) for _, b in done)
    recall = sum(vc.recall(out, batch) * len(batch[1]) for out, batch in done) / n
    return {"n": n, "total_s": total_s, "wait_s": wait_s, "recall": recall}


def pipelines(pages: Any, out: Path, bf16: bool) -> dict[str, tuple[Any, Any, int]]:
    """``name -> (run(batch), loader, threads)`` for the baseline, the hand recipe and the winner."""
    import autotune
    from autotune.data import call_model

    stock = torch.get_num_threads()
    plain = vc.craft()
    hand = vc.craft().to(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if bf16 else torch.float32

    def run_plain(batch: Any) -> Any:
        with torch.inference_mode():
            return plain(batch[0])

    def run_hand(batch: Any) -> Any:
        with torch.inference_mode(), torch.autocast("cpu", dtype=dtype, enabled=bf16):
            return hand(batch[0].contiguous(memory_format=torch.channels_last)).float()

    tuned = autotune.apply(vc.craft(), out, dataset=pages, device="cpu")
    threads = torch.get_num_threads()  # apply sets the config's threads; the others run stock
    torch.set_num_threads(stock)

    def run_tuned(batch: Any) -> Any:
        with torch.inference_mode():
            return call_model(tuned, batch)

    hand_loader = torch.utils.data.DataLoader(
        pages,
        batch_size=HAND_BATCH,
        collate_fn=pad_collate,
        num_workers=HAND_WORKERS,
        persistent_workers=True,
        prefetch_factor=2,
    )
    return {
        "baseline": (run_plain, torch.utils.data.DataLoader(pages, batch_size=BASELINE_BATCH), stock),
        "hand recipe": (run_hand, hand_loader, stock),
        "autotune": (run_tuned, autotune.dataloader(pages, out), threads),
    }


def measure(pages: Any, out: Path, bf16: bool, rounds: int) -> dict[str, list[dict[str, Any]]]:
    built = pipelines(pages, out, bf16)
    for run, loader, threads in built.values():  # warm-up: workers start, compiled code compiles
        timed_pass(run, loader, threads)
    names, passes = list(built), {k: [] for k in built}
    for i in range(rounds):
        for key in names[i % len(names) :] + names[: i % len(names)]:
            passes[key].append(timed_pass(*built[key]))
    return passes


def search_budget(w: Workload, cfg: dict[str, Any], run: dict[str, Any], n_trials: int | None) -> dict[str, Any]:
    """The search's trials, guard samples and timing: ``n_trials`` (the command line's), else the
    run's (a smoke run's), else the workload's own."""
    return {
        "n_trials": n_trials or run.get("n_trials") or w.trials(),
        "n_val": run.get("n_val") or cfg["options"]["n_val"],
        "measure": run["measure"] if "measure" in run else w.measure,
    }


def tune(cfg: dict[str, Any], out: Path, budget: dict[str, Any]) -> Any:
    import autotune

    shutil.rmtree(out, ignore_errors=True)
    return autotune.optimize(
        cfg["model"],
        cfg["dataset"],
        metric=cfg["metric"],
        n_trials=budget["n_trials"],
        baseline_batch_size=BASELINE_BATCH,
        n_val=budget["n_val"],
        measure=budget["measure"],
        device="cpu",
        out_dir=out,
        export=(),
        repeated_passes=True,  # the benchmark reads the same pages pass after pass
    )


def report(passes: dict[str, list[dict[str, Any]]], others: float) -> None:
    rates = {k: [p["n"] / p["total_s"] for p in v] for k, v in passes.items()}
    ratio = ratios_to(rates, "baseline")
    rows = []
    for name, done in passes.items():
        share = statistics.median(p["wait_s"] / p["total_s"] for p in done)
        recall = statistics.fmean(p["recall"] for p in done)
        rows.append(
            [name, f"{statistics.median(rates[name]):.2f}", f"{ratio[name]:.2f}x", f"{recall:.4f}", f"{share:.0%}"]
        )
    table(
        f"CRAFT on {passes['baseline'][0]['n']} rendered pages, one process (others' cores {others:.2f})",
        "pipeline|pages/s|vs baseline|word recall (IoU >= 0.5)|loader share",
        rows,
    )


def claim(out: Path) -> str:
    """What the run claims, the knobs its winner changed from the baseline, and its diagnosis
    (the loader and the model timed apart: which one bounds each pipeline)."""
    saved = json.loads((out / "best_config.json").read_text())
    speedup = saved.get("speedup") or {}
    said = f"{speedup['speedup']:.2f}x ({speedup.get('verdict')})" if speedup.get("speedup") else "-"
    chosen, baseline = saved.get("config") or {}, saved.get("baseline_config") or {}
    changed = " ".join(f"{k}={v}" for k, v in chosen.items() if baseline.get(k) != v)
    diagnosis = saved.get("diagnosis") or {}
    why = diagnosis.get("summary") or diagnosis.get("fault") or diagnosis.get("error") or "none"
    return f"autotune's claim: {said}; winner: {changed or 'the baseline'}\nautotune's diagnosis: {why}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vision", description=__doc__.split("\n")[0])
    parser.add_argument("--n-trials", type=int, help="trials of the search (default 16; smoke 2)")
    parser.add_argument("--load", type=Path, help="time this finished run's winner instead of tuning")
    parser.add_argument("--smoke", action="store_true", help="tiny budget: checks that everything runs")
    parser.add_argument("--out", type=Path, help="directory for the run (default: a temporary one)")
    parser.add_argument(
        "--scan",
        type=int,
        default=1,
        help="keep pages as scans this many times larger, scaled down per read (12: decode-bound)",
    )
    args = parser.parse_args(argv)
    why = vc.missing()
    if why is not None:
        print(f"benchmarks.vision: skipped, {why}.")
        return
    w, run = workload("craft"), RUNS["smoke" if args.smoke else "full"]
    out = args.load or args.out or Path(tempfile.gettempdir()) / "autotune-bench-vision"
    info = machine()
    flags = cpu_flags()
    scan = f", pages kept as {args.scan}x scans" if args.scan > 1 else ""
    print(f"CRAFT (craft_mlt_25k){scan}, {info['date']}, {info['cpu']}, {info['cpu_count']} cores")
    print(f"CPU flags: {' '.join(flags) or 'none of ' + ', '.join(FLAGS)}; bf16 units: {info['bf16']}")
    cfg = w.build(scan=args.scan, **({"n": run["n_pages"]} if args.smoke else {}))
    pages = cfg["dataset"]
    if args.load is None:
        started = time.perf_counter()
        tune(cfg, out, search_budget(w, cfg, run, args.n_trials))
        print(f"tuned in {time.perf_counter() - started:.0f} s")
    print(claim(out))
    bf16 = bool({"avx512_bf16", "amx_bf16"} & set(flags))  # native bf16 units, not emulated
    others = OthersCPU()
    passes = measure(pages, out, bf16, run["rounds"])
    report(passes, others())
    print(f"hand recipe: {'bfloat16 autocast' if bf16 else 'float32 (no bf16 units)'}, channels-last, ", end="")
    print(f"{HAND_WORKERS} workers, batch {HAND_BATCH} padded to multiples of 32")
