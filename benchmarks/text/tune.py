"""Real text, tuned: autotune against the hand recipes on a pretrained sentence encoder.

The workload of :mod:`benchmarks.text.workload` (all-MiniLM-L6-v2, real sentences) as a user brings it:
a dataset padded to 64 tokens, batched by ``default_collate`` at 32, fp32 eager. autotune
searches it (``cpu-deploy`` by default, the guard at ``max_metric_drop=0.02``: every sentence's
embedding within cosine 0.98 of the baseline's), then every pipeline is checked and timed side
by side in one process, in alternating rounds: the baseline, the hand recipes (trimmed padding,
length-sorted batches, ONNX Runtime fp32 and int8) and the tuned pipeline (``autotune.apply`` on
the run's directory and its batching, as ``autotune.predict`` runs it).

Usage (from the repository root, with the text extra and the weights installed, see
docs/text-workload.md)::

    python -m benchmarks.text.tune                       # search (about 15 min on 2 cores), then compare
    python -m benchmarks.text.tune --load OUT            # compare a finished search again
    python -m benchmarks.text.tune --search-only --out OUT && python -m benchmarks.text.tune --load OUT
                                                         # the comparison in a fresh process
    python -m benchmarks.text.tune --kept 2,4,6          # int8 rows with that many layers float, by autotune's ranking
    python -m benchmarks.text.tune --natural --trials 16 --space default   # natural lengths, the user's own collate
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

# The guard the comparison holds every pipeline to: the search's, as a cosine.
MAX_DROP = 0.02


def user_data(n: int, natural: bool) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """The samples and collate a user brings: padded to 64 tokens (``default_collate``: the
    ``text-padded`` workload), or at their natural lengths behind a collate that pads each batch
    to its longest (``text-collated``)."""
    from benchmarks.core import workload

    cfg = workload("text-collated" if natural else "text-padded").build(n=n)
    return cfg["dataset"], cfg.get("options", {}).get("collate_fn")


def search(out: Path, n: int, n_trials: int, timeout: float, space: str, natural: bool = False) -> dict[str, Any]:
    """Tune the user's dataset; the run's directory holds the result."""
    import autotune
    from benchmarks.text.workload import minilm

    samples, collate = user_data(n, natural)
    started = time.perf_counter()
    result = autotune.optimize(
        minilm,
        samples,
        collate_fn=collate,
        space=space,
        max_metric_drop=MAX_DROP,
        n_trials=n_trials,
        timeout=timeout,
        out_dir=out,
        export=("onnx",),
        device="cpu",
    )
    print(
        f"search: {len(result.study.trials)} trials in {time.perf_counter() - started:.0f} s; "
        f"verdict {result.verdict}, claimed {result.speedup:.2f}x; winner: {_changes(result.best_config)}",
        flush=True,
    )
    return dict(result.best_config)


def _changes(config: dict[str, Any]) -> str:
    from autotune.knobs import REGISTRY

    return (
        " ".join(f"{k}={v}" for k, v in config.items() if k in REGISTRY and REGISTRY[k].default not in (None, v))
        or "the baseline"
    )


def tuned_recipe(out: Path, samples: list[dict[str, torch.Tensor]], collate: Any = None) -> tuple[str, Any]:
    """The tuned pipeline as a recipe: the run's model (``autotune.apply``) fed the run's batches
    (made by the user's ``collate``, if the run had one)."""
    import autotune
    from autotune.batching import Batching, lengths_of, split_samples
    from autotune.data import call_model
    from benchmarks.text.workload import minilm

    config = json.loads((out / "best_config.json").read_text())["config"]
    model = autotune.apply(minilm(), out, dataset=samples, device="cpu")
    grouping = config["length_grouping"]
    batching = Batching(
        config["batch_size"],
        collate_fn=collate,
        padding=config["padding"],
        grouping=grouping,
        lengths=lengths_of(samples) if grouping else None,
    )

    def run() -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        rows: list[Any] = [None] * len(samples)
        with torch.inference_mode():
            for ids, batch in batching.batches(samples):
                for i, piece in zip(ids, split_samples(call_model(model, batch), batch), strict=True):
                    rows[i] = piece[0]
        return torch.stack(rows).float(), time.perf_counter() - started

    return f"autotune: {_changes(config)}", run


_RANKED = "ORT int8, autotune's ranking"


def ranked_recipes(work: Path, n: int, kept: list[int]) -> list[tuple[str, Any]]:
    """ONNX Runtime dynamic int8 with the ``k`` layers autotune ranks most sensitive kept float,
    for each ``k`` in ``kept``: the fallback's trade-off as the tool measures it. The ranking
    (autotune.compress.rank_onnx, judged by the worst sentence's cosine) runs on 96 sentences
    after the ``n`` that are timed and checked. Prints the ranking's top 8."""
    from autotune.compress import quantize_onnx_except, rank_onnx, worst_cosine
    from benchmarks.core import table
    from benchmarks.text.recipes import ort_session, ort_sorted, weight_matmuls
    from benchmarks.text.workload import PAD_TO, dataset, pad_collate

    if not kept:
        return []
    fp32 = work / "fp32.onnx"  # written by the hand recipes
    held_out = dataset(n + 96, max_length=PAD_TO)[n:]
    batches = [pad_collate(held_out[i : i + 32]) for i in range(0, len(held_out), 32)]
    started = time.perf_counter()
    ranking = rank_onnx(fp32, "int8_dynamic", batches, worst_cosine, budget_s=120)
    modules = weight_matmuls(fp32)
    rows = [
        [
            modules.get(name, name),
            f"{ranking.cheap_error[name]:.4f}",
            f"{ranking.exact_score.get(name, float('nan')):.4f}",
        ]
        for name in ranking.top(8)
    ]
    table(
        f"autotune's int8 ranking of {len(ranking.layers)} layers ({time.perf_counter() - started:.0f} s), top 8",
        "layer|cheap error|worst cosine, it alone int8",
        rows,
    )
    natural = dataset(n, max_length=PAD_TO)
    recipes = []
    for k in kept:
        path = work / f"int8-ranked-{k}.onnx"
        quantize_onnx_except(fp32, path, "int8_dynamic", ranking.top(k), batches)
        session = ort_session(path)
        recipes.append(
            (
                f"{_RANKED}, its {k} most sensitive kept float, trimmed + sorted",
                lambda s=session: ort_sorted(s, natural),
            )
        )
    return recipes


def compare(out: Path, n: int, n_rounds: int, kept: list[int] | None = None, natural: bool = False) -> dict[str, Any]:
    """Check, then time, the baseline, the hand recipes, int8 with ``kept`` layers float by
    autotune's ranking, and the tuned pipeline."""
    import tempfile

    from benchmarks.text.recipes import _recipes, check, describe_machine, median_ratio, time_rounds
    from benchmarks.text.workload import minilm, sentences

    texts = sentences(n)
    print(describe_machine(), flush=True)
    model = minilm()
    with tempfile.TemporaryDirectory() as tmp:
        recipes = _recipes(model, n, Path(tmp), sensitivity=False, n_keep_fp32=0)
        recipes += ranked_recipes(Path(tmp), n, kept or [])
        recipes.append(tuned_recipe(out, *user_data(n, natural)))
        checks = check(recipes, texts)
        timing = time_rounds(recipes, n, n_rounds)

    def ratio(label: str) -> float:
        return median_ratio(timing["seconds"], recipes[0][0], label)

    tuned = recipes[-1][0]
    hand = [label for label, _ in recipes[1:-1] if not label.startswith(_RANKED)]
    held = [label for label in hand if checks[label]["worst_cosine"] >= 1 - MAX_DROP]
    expert = max(held, key=ratio)
    print(
        f"\ntuned {ratio(tuned):.2f}x the baseline (worst cosine {checks[tuned]['worst_cosine']:.4f}); "
        f"the best hand recipe that keeps cosine >= {1 - MAX_DROP:g}: {expert}, {ratio(expert):.2f}x; "
        f"tuned / that recipe: {ratio(tuned) / ratio(expert):.2f}",
        flush=True,
    )
    return {"checks": checks, **timing, "tuned": tuned, "expert": expert}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.text.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=384, help="sentences (default 384)")
    parser.add_argument("--trials", type=int, default=30, help="trials of the search (default 30)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds of the search (default 1200)")
    parser.add_argument("--space", default="cpu-deploy", help="preset to search (default cpu-deploy)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds of the comparison (default 9)")
    parser.add_argument("--out", type=Path, default=Path("benchmark-out/text"), help="the run's directory")
    parser.add_argument("--load", type=Path, help="compare the run in this directory; no search")
    parser.add_argument(
        "--search-only",
        action="store_true",
        help="search, then stop: compare it with --load in a fresh process, as a user's would re-time it",
    )
    parser.add_argument(
        "--natural",
        action="store_true",
        help="the user's samples at their natural lengths behind a collate that pads each batch (default: padded to 64)",
    )
    parser.add_argument(
        "--kept",
        default="4,6",
        help="also time int8 with these many layers kept float by autotune's ranking (default 4,6; none: '')",
    )
    args = parser.parse_args(argv)
    out = args.load or args.out
    if args.load is None:
        search(out, args.n, args.trials, args.timeout, args.space, args.natural)
        if args.search_only:
            return 0
    kept = [int(k) for k in args.kept.split(",") if k.strip()]
    result = compare(out, args.n, args.rounds, kept, args.natural)
    (out / "text-benchmark.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
