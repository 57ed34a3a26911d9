"""Does the speedup autotune claims hold up? Claimed against an independent re-measurement.

    python -m benchmarks.claims                 # quickstart, digits, transformer; about 6 minutes
    python -m benchmarks.claims --load          # the same with a CPU hog running beside the tuning
    python -m benchmarks.claims --smoke         # CI: quickstart only, tiny budget

For each workload:

1. ``autotune.optimize`` tunes it (with ``--load``, while a process keeps one core busy, as a
   user's other work would; the hog stops when the tuning ends).
2. Fresh Python processes then time the baseline and the winner independently of autotune's
   own timing code: each process builds the workload's model, applies the configuration with
   ``autotune.apply`` and ``autotune.dataloader`` (what a user deploys), and iterates the loader
   end to end for a fixed time. Processes alternate (baseline, winner, winner, baseline, ...),
   and the ratio is the geometric mean of the pairs.
3. The table shows the claim (or the tool's refusal to claim one), the independent ratio and
   their agreement. A claim within 25% of the independent ratio holds; a run on a busy machine
   must either hold or say it was too noisy to claim.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.core import OthersCPU, machine, table, workload, workloads

ROOT = Path(__file__).resolve().parent.parent
AGREEMENT = 0.25  # a claim within this relative distance of the independent ratio holds
# The run's own settings. The workloads (those registered for "claims") bring their trials and
# timing; the smoke run tunes one of them with fewer trials.
RUNS = {
    "full": {"pairs": 3, "seconds": 3.0},
    "smoke": {"workloads": ("quickstart",), "n_trials": 2, "pairs": 1, "seconds": 0.5},
}


def _hog(seconds: float) -> int:
    """Start a process that keeps one core busy, as another user's work would: launched through
    a process that exits at once, so it is not this benchmark's descendant (which count as its
    own CPU time), and return its pid."""
    busy = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
    launch = (
        "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', "
        f"{busy!r}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True).pid)"
    )
    return int(subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, check=True).stdout)


def time_once(name: str, config: dict[str, Any], seconds: float) -> float:
    """In this (fresh) process: samples/s of ``config`` applied to workload ``name``, end to end."""
    import torch

    import autotune
    from autotune.data import model_inputs

    cfg = workload(name).build()
    model = cfg["model"]() if not isinstance(cfg["model"], torch.nn.Module) else cfg["model"]
    dataset = (
        cfg["dataset"]() if callable(cfg["dataset"]) and not hasattr(cfg["dataset"], "__getitem__") else cfg["dataset"]
    )
    tuned = autotune.apply(model.eval(), config, dataset=dataset)
    loader = autotune.dataloader(dataset, config)
    n, start, warm = 0, None, 3
    with torch.inference_mode():
        while True:
            for batch in loader:
                args, kwargs = model_inputs(batch)
                tuned(*args, **kwargs)
                if warm:
                    warm -= 1
                    if not warm:
                        start = time.perf_counter()
                    continue
                n += len(batch[0]) if isinstance(batch, (tuple, list)) else len(next(iter(batch.values())))
                if time.perf_counter() - start >= seconds:
                    return n / (time.perf_counter() - start)


def independent(name: str, baseline: dict, best: dict, pairs: int, seconds: float) -> list[float]:
    """Winner/baseline ratios from fresh processes, one process per measurement, order alternating."""
    ratios = []
    for i in range(pairs):
        sps = {}
        for which in ("baseline", "best") if i % 2 == 0 else ("best", "baseline"):
            config = baseline if which == "baseline" else best
            code = (
                "import json, sys; from benchmarks.claims import time_once; "
                f"print(json.dumps(time_once({name!r}, json.loads(sys.argv[1]), {seconds})))"
            )
            done = subprocess.run(
                [sys.executable, "-c", code, json.dumps(config)], capture_output=True, text=True, cwd=ROOT, timeout=600
            )
            if done.returncode != 0:
                raise RuntimeError(f"re-measuring {name} {which} failed: {done.stderr.strip()[-500:]}")
            sps[which] = json.loads(done.stdout.strip().splitlines()[-1])
        ratios.append(sps["best"] / sps["baseline"])
    return ratios


def check(name: str, out: Path, budget: dict[str, Any], load: bool) -> dict[str, Any]:
    import autotune

    w = workload(name)
    cfg = w.build()
    shutil.rmtree(out / name, ignore_errors=True)
    options = dict(cfg.get("options") or {})
    n_trials = budget.get("n_trials") or w.trials()
    options.update(n_trials=n_trials, out_dir=out / name, export=(), measure=w.measure, device="cpu")
    others = OthersCPU()
    hog = _hog(3600) if load else None
    try:
        kwargs = {k: cfg[k] for k in ("metric", "max_metric_drop", "space") if k in cfg}
        result = autotune.optimize(cfg["model"], cfg["dataset"], **{**kwargs, **options})
    finally:
        if hog is not None:
            os.kill(hog, signal.SIGKILL)
    busy = others()
    saved = json.loads((out / name / "best_config.json").read_text())
    baseline = saved["baseline_config"]
    same = result.best_config == baseline
    ratios = [1.0] if same else independent(name, baseline, result.best_config, budget["pairs"], budget["seconds"])
    # A pick the confirmation refused to claim (baseline kept): what it would have given.
    rejected = saved["speedup"].get("rejected_trial")
    rejected_ratio = None
    if rejected is not None:
        pick = result.study.trials[rejected].user_attrs["config"]
        picked = independent(name, baseline, pick, budget["pairs"], budget["seconds"])
        rejected_ratio = math.exp(statistics.fmean(math.log(r) for r in picked))
    truth = math.exp(statistics.fmean(math.log(r) for r in ratios))
    agreement = result.speedup / truth
    if result.verdict == "noisy":
        verdict = "said too noisy to claim"
    elif result.verdict == "unconfirmed":
        verdict = "unconfirmed"
    else:
        verdict = "holds" if abs(agreement - 1) <= AGREEMENT else "FALSE CLAIM"
    return {
        "workload": name,
        "load": load,
        "claim": result.claim,
        "verdict": result.verdict,
        "claimed": result.speedup,
        "ci": [result.speedup_min, result.speedup_max],
        "independent": truth,
        "independent_pairs": ratios,
        "agreement": agreement,
        "outcome": verdict,
        "rejected_pick": {
            "trial": rejected,
            "claimed": (saved["speedup"].get("rejected") or {}).get("speedup"),
            "independent": rejected_ratio,
        },
        "others_cores_while_tuning": busy,
        "changes": {k: v for k, v in result.best_config.items() if baseline.get(k) != v},
    }


def _rejected(pick: dict[str, Any]) -> str:
    if pick["trial"] is None:
        return "-"
    return f"trial {pick['trial']}: {pick['claimed']:.2f}x, {pick['independent']:.2f}x"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.claims", description=__doc__.split("\n")[0])
    parser.add_argument("--load", action="store_true", help="keep one core busy while tuning")
    parser.add_argument("--smoke", action="store_true", help="tiny budget: checks that everything runs")
    parser.add_argument("--out", type=Path, help="directory for the runs and claims.json")
    args = parser.parse_args(argv)
    budget = RUNS["smoke" if args.smoke else "full"]
    out = args.out or Path(tempfile.gettempdir()) / "autotune-bench-claims"
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    started = time.perf_counter()
    print(f"claims vs independent re-measurement, {info['date']}, {info['cpu']}, {info['cpu_count']} cores, "
          f"{info['cpu_capability']}; load: {'one core kept busy while tuning' if args.load else 'none added'}")  # fmt: skip
    names = budget.get("workloads") or [w.name for w in workloads(benchmark="claims")]
    rows = [check(name, out, budget, args.load) for name in names]
    cells = [
        [
            r["workload"],
            f"{r['others_cores_while_tuning']:.2f}",
            r["verdict"],
            f"{r['claimed']:.2f}x [{r['ci'][0]:.2f}-{r['ci'][1]:.2f}]",
            f"{r['independent']:.2f}x",
            f"{r['agreement']:.2f}",
            r["outcome"],
            " ".join(f"{k}={v}" for k, v in r["changes"].items()) or "(the baseline)",
            _rejected(r["rejected_pick"]),
        ]
        for r in rows
    ]
    title = "Claimed vs independent fresh-process speedup" + (" (one core busy while tuning)" if args.load else "")
    header = (
        "workload|others' cores while tuning|verdict|claimed [95% CI]|independent|claimed/independent|outcome|"
        "winner's changes|pick not claimed: its rounds' ratio, independent"
    )
    text = table(title, header, cells)
    wall = time.perf_counter() - started
    print(f"total wall time: {wall:.0f} s")
    (out / "claims.json").write_text(json.dumps({"machine": info, "rows": rows, "wall_s": wall}, indent=2) + "\n")
    (out / "claims.md").write_text(text)


if __name__ == "__main__":
    main()
