"""The staged strategy, replayed on tables of throughputs through the real study loop: what it
screens, what it composes, what it leaves out, and a study shared by two workers."""

import threading

import optuna
import pytest

from autotune.config import Config
from autotune.errors import ConfigError
from autotune.run.options import Options
from autotune.search.strategy import Staged, check_strategy
from autotune.search.study import make_sampler, run_trials
from benchmarks.replay import TableRunner, configs_of, space_of

SPACE = {
    "amp_dtype": ["float32", "bfloat16"],
    "padding": ["as_given", "trim"],
    "length_grouping": [0, 16],
    "batch_size": [32, 64],
    "num_threads": [1, 2],
}


def _table(speed, values=SPACE):
    space = space_of(values)
    return space, {
        k: {"status": "ok", "samples_per_s": speed(c), "metric_drop": 0.0} for k, c in configs_of(space).items()
    }


def _trimmed_times_bf16(trim, bf16):
    """Trimmed, grouped padding and bf16 multiply the speed by ``trim`` and ``bf16``; one thread halves it."""

    def speed(c):
        x = 100.0 * (trim if c["padding"] == "trim" and c["length_grouping"] else 1.0)
        return x * (bf16 if c["amp_dtype"] == "bfloat16" else 1.0) * (0.5 if c["num_threads"] == 1 else 1.0)

    return speed


def _best_config(study):
    return max(_measured(study), key=lambda t: t.user_attrs["samples_per_s"]).user_attrs["config"]


def _independent(c):
    """bf16 and trimmed, grouped padding each pay alone and multiply; one thread halves."""
    x = 100.0 * (2.0 if c["amp_dtype"] == "bfloat16" else 1.0)
    x *= 1.8 if c["padding"] == "trim" and c["length_grouping"] else 1.0
    return x * (0.5 if c["num_threads"] == 1 else 1.0) * (1.01 if c["batch_size"] == 64 else 1.0)


def _run(space, table, n_trials, study=None, seed=0):
    study = study or optuna.create_study(direction="maximize", sampler=make_sampler(seed))
    runner = TableRunner(table)
    run_trials(
        study,
        runner,
        space,
        n_trials=n_trials,
        timeout=None,
        max_metric_drop=0.01,
        objectives=["throughput"],
        extra_attrs={},
        strategy=Staged(space, ["throughput"]),
    )
    return study, runner


def _measured(study):
    return [t for t in study.trials if t.user_attrs.get("ran") and t.user_attrs.get("repeat_of") is None]


def test_two_levers_that_pay_alone_are_measured_together_within_eight_trials():
    space, table = _table(_independent)
    study, _ = _run(space, table, 8)
    configs = [t.user_attrs["config"] for t in _measured(study)]
    assert len(configs) == 8
    both = [c for c in configs if c["amp_dtype"] == "bfloat16" and c["padding"] == "trim" and c["length_grouping"]]
    assert both, [Config(c).key() for c in configs]
    assert study.trials[0].user_attrs["baseline"]


def _configs_of(study):
    return [t.user_attrs["config"] for t in _measured(study)]


def test_the_recipe_the_data_and_device_vouch_for_is_measured_second_and_built_on():
    """Real MiniLM text, measured: bf16 with trimmed, grouped padding is the expert's start on a
    CPU with 16-bit units, at the user's batch (a larger one pads more and, on a CPU, runs no
    faster: 0.52x at 128 against 32); compile paid only on top of it (alone it ran 1.0x). The recipe is trial 1;
    each of its levers is taken back out right after it (seconds each), the batch is climbed,
    and compile, the costly build, is tried once on the best of that, before anything is
    screened alone."""

    def speed(c):
        x = _independent(c)
        return x * (1.3 if c["compile_mode"] == "default" and c["amp_dtype"] == "bfloat16" else 1.0)

    space, table = _table(speed, {**SPACE, "compile_mode": ["none", "default"]})
    study, _ = _run(space, table, 6)
    configs = _configs_of(study)
    ablated = configs[2:4]
    assert {(c["amp_dtype"], c["padding"]) for c in ablated} == {("float32", "trim"), ("bfloat16", "as_given")}
    compiled = [i for i, c in enumerate(configs) if c["compile_mode"] == "default"]
    assert compiled == [5], [Config(c).key() for c in configs]  # one costly build, after the cheap ones
    recipe = configs[1]
    assert (recipe["amp_dtype"], recipe["padding"], recipe["length_grouping"], recipe["batch_size"]) == (
        "bfloat16",
        "trim",
        16,
        32,
    )
    assert _measured(study)[1].user_attrs["phase"] == "recipe"
    best = _best_config(study)
    assert best["compile_mode"] == "default" and best["amp_dtype"] == "bfloat16" and best["padding"] == "trim"
    assert not [c for c in configs[1:] if c["amp_dtype"] == "float32" and c["padding"] == "as_given"], configs


def test_a_recipe_lever_that_costs_is_found_before_a_costly_build_and_left_out_of_it():
    """Pre-padded real text on a CPU with bf16 units but no AMX: the recipe (bf16 + trimmed +
    grouped) ran 1.20x, and nine compiles were built on it before bf16 was taken out at trial 11
    (fp32 + trim + compile: 2.7x). The ablation comes right after the recipe, and the compile
    goes on the recipe without bf16."""

    def speed(c):
        x = 100.0 * (2.2 if c["padding"] == "trim" and c["length_grouping"] else 1.0)
        x *= 0.55 if c["amp_dtype"] == "bfloat16" else 1.0
        return x * (1.25 if c["compile_mode"] == "default" else 1.0) * (0.5 if c["num_threads"] == 1 else 1.0)

    space, table = _table(speed, {**SPACE, "compile_mode": ["none", "default"]})
    study, _ = _run(space, table, 6)
    configs = _configs_of(study)
    assert (configs[2]["amp_dtype"], configs[3]["amp_dtype"]) in (("float32", "bfloat16"), ("bfloat16", "float32"))
    compiled = [c for c in configs if c["compile_mode"] == "default"]
    assert compiled and all(c["amp_dtype"] == "float32" and c["padding"] == "trim" for c in compiled), configs
    assert _best_config(study)["compile_mode"] == "default"


def test_a_recipe_lever_that_costs_inside_the_recipe_is_taken_back_out():
    """Trimmed padding doubles the speed and bf16 costs 10% (a CPU whose bf16 units do not pay on
    this model): the recipe still pays, and taking bf16 back out of it finds the faster pipeline."""

    space, table = _table(_trimmed_times_bf16(2.0, 0.9))
    study, _ = _run(space, table, 6)
    best = _best_config(study)
    assert (best["amp_dtype"], best["padding"]) == ("float32", "trim"), _configs_of(study)


def test_a_recipe_that_does_not_pay_leaves_each_lever_to_be_screened_alone():
    """bf16 emulated at a third of the speed sinks the recipe; its levers are then screened
    alone: trimmed padding is found, and bf16 is left out."""

    space, table = _table(_trimmed_times_bf16(1.5, 0.33))
    study, _ = _run(space, table, 6)
    measured = _measured(study)
    assert measured[1].user_attrs["phase"] == "recipe"
    phases = [t.user_attrs.get("phase") for t in measured]
    assert phases.count("screen") >= 2, phases
    best = _best_config(study)
    assert (best["amp_dtype"], best["padding"]) == ("float32", "trim")
    left = Staged(space, ["throughput"]).left_out([t.user_attrs for t in measured])
    assert any(changes.get("amp_dtype") == "bfloat16" for changes, _ in left), left


def test_screening_leaves_out_a_value_that_halves_throughput():
    space, table = _table(_independent)
    study, runner = _run(space, table, 12)
    refused = [t for t in study.trials if t.user_attrs.get("kind") == "screened"]
    measured = _measured(study)
    one_thread = [t for t in measured if t.user_attrs["config"]["num_threads"] == 1]
    assert len(one_thread) == 1, "one thread was measured again after it halved throughput"
    later = [t for t in study.trials if t.number > one_thread[0].number and t.user_attrs.get("config")]
    assert all(t.user_attrs.get("ran") is False for t in later if t.user_attrs["config"]["num_threads"] == 1)
    for t in refused:
        assert t.user_attrs["reason"].startswith("left out after screening: measured 0.5")
        assert "num_threads=1" in t.user_attrs["reason"] and t.state == optuna.trial.TrialState.PRUNED
    assert runner.calls == len(measured)  # a refused configuration never reached the runner
    assert Staged(space, ["throughput"]).left_out([t.user_attrs | {"key": t.user_attrs["key"]} for t in measured])


def test_loader_workers_are_tried_beside_the_threads_they_leave_free():
    """On 2 cores a decode-bound pipeline: one thread alone halves the model, 2 workers beside 2
    threads fight for the cores (0.25x), 2 workers beside 1 thread hide the decoding (2x). Neither
    harmful value keeps the search from measuring the pair that pays, and each is left out only
    beside the value it was measured with."""

    def speed(c):
        workers, threads = c["num_workers"], c["num_threads"]
        x = {(0, 2): 100.0, (0, 1): 50.0, (2, 2): 25.0, (2, 1): 200.0}[(workers, threads)]
        return x * (1.01 if c["batch_size"] == 64 else 1.0)

    space = space_of({"batch_size": [32, 64], "num_workers": [0, 2], "num_threads": [1, 2]})
    table = {k: {"status": "ok", "samples_per_s": speed(c), "metric_drop": 0.0} for k, c in configs_of(space).items()}
    study, _ = _run(space, table, 6)
    best = max(_measured(study), key=lambda t: t.user_attrs["samples_per_s"])
    assert (best.user_attrs["config"]["num_workers"], best.user_attrs["config"]["num_threads"]) == (2, 1)
    assert best.number <= 4, [t.user_attrs.get("config") for t in _measured(study)]
    refused = [t.user_attrs["config"] for t in study.trials if t.user_attrs.get("kind") == "screened"]
    assert all((c["num_workers"], c["num_threads"]) in ((0, 1), (2, 2)) for c in refused), refused
    # One thread measured harmful beside no workers is refused there, not beside 2 workers.
    staged = Staged(space, ["throughput"])
    one_thread = [({"num_threads": 1, "num_workers": 0}, 0.5)]
    assert staged._refuse(staged._full({"num_threads": 1}), one_thread) is not None
    assert staged._refuse(staged._full({"num_threads": 1, "num_workers": 2}), one_thread) is None


def test_decoding_once_is_tried_before_workers_that_only_hide_it():
    """A decode-bound pipeline over a fixed set: the cache (decode once, every core to the model)
    beats workers beside fewer threads; non-persistent workers lose their cache every epoch."""

    def speed(c):
        cached = c["cache_decoded"] and (c["num_workers"] == 0 or c["persistent_workers"])
        if cached:
            x = 200.0 if c["num_threads"] == 2 else 100.0
        else:
            x = {(0, 2): 100.0, (0, 1): 60.0, (2, 2): 25.0, (2, 1): 180.0}[(c["num_workers"], c["num_threads"])]
        return x * (1.01 if c["batch_size"] == 64 else 1.0)

    values = {"batch_size": [32, 64], "num_workers": [0, 2], "persistent_workers": [False, True]}
    space = space_of({**values, "cache_decoded": [False, True], "num_threads": [1, 2]})
    table = {k: {"status": "ok", "samples_per_s": speed(c), "metric_drop": 0.0} for k, c in configs_of(space).items()}
    study, _ = _run(space, table, 6)
    best = max(_measured(study), key=lambda t: t.user_attrs["samples_per_s"])
    config = best.user_attrs["config"]
    assert config["cache_decoded"] and config["num_threads"] == 2, [
        t.user_attrs.get("config") for t in _measured(study)
    ]
    assert best.number <= 4


def test_a_lever_harmful_at_the_baseline_batch_is_tried_again_at_the_best_batch():
    """The quickstart MLP, measured: bfloat16 ran 0.67x at the baseline's batch 32 and was the
    optimum at 512. Left out at batch 32 only, it is tried at the composed best's batch."""

    def speed(c):
        b = c["batch_size"]
        x = {32: 300.0, 128: 540.0, 512: 640.0}[b]
        return x * ({32: 0.67, 128: 1.2, 512: 1.45}[b] if c["amp_dtype"] == "bfloat16" else 1.0)

    space = space_of({"batch_size": [32, 128, 512], "amp_dtype": ["float32", "bfloat16"]})
    table = {k: {"status": "ok", "samples_per_s": speed(c), "metric_drop": 0.0} for k, c in configs_of(space).items()}
    study, _ = _run(space, table, 6)
    found = [(t.user_attrs["config"]["batch_size"], t.user_attrs["config"]["amp_dtype"]) for t in _measured(study)]
    assert (512, "bfloat16") in found, found
    assert not [
        t for t in study.trials if t.user_attrs.get("kind") == "screened" and t.user_attrs["config"]["batch_size"] != 32
    ]


def test_a_second_tier_lever_within_the_noise_is_not_kept_for_what_comes_after():
    """CRAFT over 16x page scans: while decoding bound the pipeline, one thread measured 1.7%
    faster. Kept, it halved the model once the decoded-sample cache removed the decoding; a
    lever is kept only if it pays (3%), so the cache is measured beside both threads."""

    def speed(c):
        model_s = (0.08 if c["amp_dtype"] == "bfloat16" else 0.1) * (2.0 if c["num_threads"] == 1 else 1.0)
        if c["cache_decoded"]:
            return 1.0 / (0.001 + model_s)
        x = 1.0 / 0.26 * (1.2 if c["amp_dtype"] == "bfloat16" else 1.0)
        return x * (1.017 if c["num_threads"] == 1 else 1.0)

    space = space_of({"amp_dtype": ["float32", "bfloat16"], "num_threads": [1, 2], "cache_decoded": [False, True]})
    table = {k: {"status": "ok", "samples_per_s": speed(c), "metric_drop": 0.0} for k, c in configs_of(space).items()}
    study, _ = _run(space, table, 4)
    best = max(_measured(study), key=lambda t: t.user_attrs["samples_per_s"]).user_attrs["config"]
    assert (best["amp_dtype"], best["cache_decoded"], best["num_threads"]) == ("bfloat16", True, 2)


def test_a_lever_that_did_not_pay_is_tried_at_the_best_batch_before_a_smaller_batch():
    """Digits, 10 trials: bfloat16 ran 1.01x at batch 32, compile paid, the batch lever moved to
    128; the budget ended on the batch neighbours before bfloat16 was tried at 128. The retry
    comes right after the larger neighbour."""

    def speed(c):
        x = {32: 50.0, 64: 75.0, 128: 100.0, 256: 98.0}[c["batch_size"]]
        x *= 1.5 if c["compile_mode"] == "default" else 1.0
        return x * ({32: 1.01, 64: 1.1, 128: 1.3, 256: 1.35}[c["batch_size"]] if c["amp_dtype"] == "bfloat16" else 1.0)

    space = space_of(
        {"batch_size": [32, 64, 128, 256], "amp_dtype": ["float32", "bfloat16"], "compile_mode": ["none", "default"]}
    )
    table = {k: {"status": "ok", "samples_per_s": speed(c), "metric_drop": 0.0} for k, c in configs_of(space).items()}
    study, _ = _run(space, table, 6)
    found = [
        (
            t.user_attrs["config"]["batch_size"],
            t.user_attrs["config"]["amp_dtype"],
            t.user_attrs["config"]["compile_mode"],
        )
        for t in _measured(study)
    ]
    # bfloat16 at a batch where it pays, under the compile: within 2% of the table's best.
    best = _best_config(study)
    assert (best["amp_dtype"], best["compile_mode"]) == ("bfloat16", "default") and best["batch_size"] >= 128, found


def test_a_shared_study_of_two_workers_runs_each_screening_config_once(tmp_path):
    """Two workers of one study, each on the storage as a run opens it (SQLite transactions
    serialized): on Optuna's own SQLite storage both could pop the same queued trial, and the
    second to tell it raised "Cannot tell a COMPLETE trial" (1 run in 15-25 here)."""
    from autotune.search.storage import open_storage

    space, table = _table(_independent)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(study_name="shared", storage=open_storage(url), direction="maximize")
    errors = []

    def work(seed):
        try:
            storage = open_storage(url)
            study = optuna.load_study(study_name="shared", storage=storage, sampler=make_sampler(seed, parallel=True))
            _run(space, table, 10, study)
        except BaseException as exc:  # raised in the test below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    study = optuna.load_study(study_name="shared", storage=url)
    keys = [t.user_attrs["key"] for t in _measured(study)]
    assert len(keys) == len(set(keys)), "a configuration was measured twice"
    # Both stop at the shared budget, or where refinement stopped paying: how soon the staged
    # phases end depends on how the two interleave (8 measured, both "converged", in 1 run of 15).
    assert len(keys) == 10 or study.user_attrs.get("converged"), (len(keys), study.user_attrs)
    staged = Staged(space, ["throughput"])
    # The recipe (bf16 with trimmed, grouped padding) is measured once, by one of the two.
    assert keys.count(Config(staged.recipe()).key()) == 1
    # Queued twice at the same moment, the younger twin is withdrawn before it is asked for; one
    # asked for first is answered by the claim on its key without running.
    phases = ("recipe", "screen", "compose")
    queued = [t for t in study.trials if t.user_attrs.get("phase") in phases and not t.user_attrs.get("withdrawn")]
    asked = [t for t in queued if t.user_attrs.get("ran")]
    assert len({t.user_attrs["key"] for t in asked}) == len(asked), "a queued config was measured twice"


@pytest.mark.parametrize("n_trials", [2, 3, 5])
def test_a_run_that_ends_at_its_trial_budget_leaves_no_trial_queued_behind(n_trials):
    """Screening queued all its levers at once: a two-trial run ended with two of them in
    trials.csv as "queued, not started", beside a summary that said 2 trials ran."""
    from optuna.trial import TrialState

    space, table = _table(_independent)
    study, _ = _run(space, table, n_trials)
    assert len(_measured(study)) == n_trials
    assert [t.number for t in study.trials if t.state == TrialState.WAITING] == []


def test_strategy_is_checked():
    assert check_strategy("staged") == "staged"
    with pytest.raises(ConfigError, match=r"No strategy named 'greedy'\. Known: staged, tpe\."):
        Options(strategy="greedy")


def test_strategy_is_staged_by_default():
    assert Options().strategy == "staged"


def _size(c):
    """int8 quarters the model and pruning shrinks it by its ratio; a ratio of 0.5 or more
    breaks the guard."""
    size = 1000.0 * (0.25 if c["quantization"] == "int8_dynamic" else 1.0) * (1.0 - c["prune_ratio"])
    return {"status": "ok", "size_bytes_compressed": size, "metric_drop": 0.05 if c["prune_ratio"] >= 0.5 else 0.0}


def test_with_size_first_int8_and_pruning_are_screened_then_composed():
    space = space_of({"quantization": ["none", "int8_dynamic"], "prune_ratio": [0.0, 0.3, 0.5]})
    table = {k: _size(c) for k, c in configs_of(space).items()}
    study = optuna.create_study(direction="minimize", sampler=make_sampler(0))
    run_trials(
        study,
        TableRunner(table),
        space,
        n_trials=5,
        timeout=None,
        max_metric_drop=0.01,
        objectives=["size"],
        extra_attrs={},
        strategy=Staged(space, ["size"]),
    )
    staged = Staged(space, ["size"])
    assert [lever.name for lever in staged.levers] == ["int8", "prune_ratio"]
    configs = [
        (t.user_attrs["config"]["quantization"], t.user_attrs["config"]["prune_ratio"]) for t in _measured(study)
    ]
    # int8 on the baseline (float32, every layer), the largest ratio (it breaks the guard), the
    # next, then the two together: the smallest that passes, found by the fifth trial.
    assert configs[:4] == [("none", 0.0), ("int8_dynamic", 0.0), ("none", 0.5), ("none", 0.3)], configs
    assert ("int8_dynamic", 0.3) in configs


def test_int8_fallback_values_beyond_the_models_layers_are_not_offered():
    import torch
    from torch import nn

    from autotune.run.plan import plan

    class Recurrent(nn.Module):  # a GRU and a Linear: two layers int8 can quantize
        def __init__(self):
            super().__init__()
            self.gru, self.head = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.gru(x)[0][:, -1])

    data = [torch.randn(5, 8) for _ in range(64)]
    _, _, space = plan(Recurrent(), data, space={"base": None, "quantization": "all", "int8_fallback": "all"}, n_val=16)
    assert space.values["int8_fallback"] == [0, 1, "auto"]
    assert "the model has 2 layers int8 can quantize" in space.excluded["int8_fallback"]["2"]


def test_training_mode_screens_the_training_knobs_and_leaves_out_what_halves_a_step(cpu_env):
    """A training space as plan() resolves it (micro-batches dividing the effective batch, the
    optimizer's implementations): the optimizer's implementation is screened alone against the
    baseline, and one thread, which halves the step, is measured once and left out, so the fused
    optimizer wins beside both threads."""
    import dataclasses

    import autotune
    from tests.models import MLP, classification_data

    _, _, planned = autotune.plan(
        MLP(), classification_data(n=256), mode="train", space={"base": None, "optimizer_impl": "all"}
    )
    assert planned.values["optimizer_impl"] == ["default", "foreach", "fused"]
    assert planned.values["quantization"] == ["none"] and planned.values["compile_mode"] == ["none"]
    # The thread counts pinned, so the test holds on a machine of any core count.
    space = dataclasses.replace(
        planned,
        values={**planned.values, "num_threads": [1, 2], "batch_size": [8, 16, 32]},
        baseline={**planned.baseline, "num_threads": 2, "batch_size": 32},
    )

    def speed(c):
        x = 100.0 * {"default": 1.0, "foreach": 1.1, "fused": 1.5}[c["optimizer_impl"]]
        return x * (0.5 if c["num_threads"] == 1 else 1.0) * {8: 0.7, 16: 0.9, 32: 1.0}[c["batch_size"]]

    table = {k: {"status": "ok", "samples_per_s": speed(c), "metric_drop": 0.0} for k, c in configs_of(space).items()}
    study, runner = _run(space, table, 8)
    measured = _measured(study)
    changed = [
        {k: v for k, v in t.user_attrs["config"].items() if v != space.baseline[k]}
        for t in measured
        if t.user_attrs.get("phase") == "screen"
    ]
    assert changed == [{"optimizer_impl": "fused"}], changed
    assert len([t for t in measured if t.user_attrs["config"]["num_threads"] == 1]) == 1
    refused = [t for t in study.trials if t.user_attrs.get("kind") == "screened"]
    assert refused and all("num_threads=1" in t.user_attrs["reason"] for t in refused)
    best = max(measured, key=lambda t: t.user_attrs["samples_per_s"])
    assert best.user_attrs["config"]["optimizer_impl"] == "fused" and best.user_attrs["config"]["num_threads"] == 2
    assert runner.calls == len(measured)


CUDA_SPACE = {
    "gather": ["per_sample", "batched"],
    "pin_memory": [False, True],
    "device_prefetch": [False, True],
    "num_workers": [0, 4, 8],
    "persistent_workers": [False, True],
    "prefetch_factor": [2, 4],
    "amp_dtype": ["float32", "bfloat16"],
    "compile_mode": ["none", "default", "reduce-overhead"],
    "batch_size": [64, 128, 256],
}


def _fed(c):
    """An input-bound pipeline, as ResNet-50 on an H100: the slower of what the host feeds and
    what the model runs. Feeding: batched gather x3, pinned x1.5 (prefetched x1.3 more), workers
    kept alive x2. The model: bf16 x2, compile x1.3, a larger batch a little."""
    feed = 2000.0 * (3 if c["gather"] == "batched" else 1) * (1.5 if c["pin_memory"] else 1)
    feed *= (1.3 if c["device_prefetch"] and c["pin_memory"] else 1) * (2 if c["num_workers"] else 1)
    feed *= 1.2 if c["num_workers"] and c["persistent_workers"] else 1
    model = 6000.0 * (2 if c["amp_dtype"] == "bfloat16" else 1) * (1.3 if c["compile_mode"] != "none" else 1)
    model *= {64: 1.0, 128: 1.05, 256: 1.1}[c["batch_size"]]
    return min(feed, model)


def _run_cuda(space, table, n_trials):
    study = optuna.create_study(direction="maximize", sampler=make_sampler(0))
    run_trials(study, TableRunner(table), space, n_trials=n_trials, timeout=None, max_metric_drop=0.01,
               objectives=["throughput"], extra_attrs={}, strategy=Staged(space, ["throughput"], "cuda", 16))  # fmt: skip
    return study


def test_on_cuda_the_data_path_is_screened_and_composed_before_compile():
    """A ResNet-50 fed per-sample collated batches from pageable memory sat near 3,000 img/s on
    an H100 for every model recipe: no compile can lift an input-bound pipeline. On a CUDA device
    the recipe takes the batched gather and pinned, prefetched copies, and workers are tried
    before any compile."""
    space, table = _table(_fed, CUDA_SPACE)
    space.baseline.update(batch_size=64)
    study = _run_cuda(space, table, 10)
    configs = [t.user_attrs["config"] for t in _measured(study)]
    recipe = configs[1]
    assert recipe["gather"] == "batched" and recipe["pin_memory"] and recipe["device_prefetch"], recipe
    first_compile = next((i for i, c in enumerate(configs) if c["compile_mode"] != "none"), len(configs))
    first_workers = next(i for i, c in enumerate(configs) if c["num_workers"])
    assert first_workers < first_compile, [Config(c).key() for c in configs]
    assert configs[first_workers]["num_workers"] == 8 and configs[first_workers]["persistent_workers"]
    best = _best_config(study)
    assert best["gather"] == "batched" and best["pin_memory"] and best["num_workers"], best
    assert _fed(best) >= 0.95 * max(_fed(c) for c in configs_of(space).values())


def test_on_the_cpu_the_data_path_levers_stay_out_of_the_first_tier():
    space = space_of({"num_workers": [0, 2], "amp_dtype": ["float32", "bfloat16"], "compile_mode": ["none", "default"]})
    staged = Staged(space, ["throughput"], "cpu", 2)
    assert "num_workers" not in staged.tier1 and "pin_memory" not in [lever.name for lever in staged.levers]


def test_a_launch_bound_best_tries_cuda_graphs_next():
    """Where the model alone said the host's kernel launches bound the trial (small batches,
    small models), reduce-overhead is the next move around the best."""
    values = {"batch_size": [8, 16], "compile_mode": ["none", "default", "reduce-overhead"]}
    space = space_of(values)
    space.baseline.update(batch_size=8)

    def result(c):
        launch = c["compile_mode"] != "reduce-overhead"
        speed = 1000.0 * (3 if not launch else 1) * (1.02 if c["batch_size"] == 16 else 1)
        return {"status": "ok", "samples_per_s": speed, "metric_drop": 0.0,
                "bound": "launch-bound" if launch else "compute-bound"}  # fmt: skip

    table = {k: result(c) for k, c in configs_of(space).items()}
    study = _run_cuda(space, table, 4)
    configs = [t.user_attrs["config"] for t in _measured(study)]
    assert any(c["compile_mode"] == "reduce-overhead" for c in configs[:4]), [Config(c).key() for c in configs]
    assert _best_config(study)["compile_mode"] == "reduce-overhead"


def test_an_input_bound_best_whose_feed_was_worked_on_tries_cuda_graphs():
    """The feed fixed (the feeder thread, the data on the device) and still input-bound: the
    launches sit on the host thread that feeds the device, and CUDA graphs take them off it. A
    best input-bound with nothing of the feed on gets the feed's levers first, not the graphs."""
    values = {"batch_size": [8, 16], "feed_ahead": [0, 2], "compile_mode": ["none", "default", "reduce-overhead"]}
    space = space_of(values)
    space.baseline.update(batch_size=8)

    def result(c):
        speed = 1000.0 * (2 if c["feed_ahead"] else 1) * (1.5 if c["compile_mode"] == "reduce-overhead" else 1)
        bound = "compute-bound" if c["compile_mode"] == "reduce-overhead" else "input-bound"
        return {"status": "ok", "samples_per_s": speed, "metric_drop": 0.0, "bound": bound}

    table = {k: result(c) for k, c in configs_of(space).items()}
    study = _run_cuda(space, table, 5)
    configs = [t.user_attrs["config"] for t in _measured(study)]
    fed_at = next(i for i, c in enumerate(configs) if c["feed_ahead"])
    graphs_at = next(i for i, c in enumerate(configs) if c["compile_mode"] == "reduce-overhead")
    assert fed_at < graphs_at <= fed_at + 2, [Config(c).key() for c in configs]
    assert configs[graphs_at]["feed_ahead"] == 2
    assert _best_config(study)["compile_mode"] == "reduce-overhead"


def test_a_space_offering_only_cuda_graphs_screens_the_compile_in_that_mode():
    """On an H200 a user's space of compile modes none and reduce-overhead never compiled: the
    compile lever knew only the default modes, bfloat16 ran 0.31x on a small MLP, and the
    CUDA-graph move waited for a launch-bound best the model alone did not report. The compile is
    screened alone in the mode the space offers, and it wins."""
    space = space_of({"compile_mode": ["none", "reduce-overhead"], "amp_dtype": ["float32", "bfloat16"]})

    def result(c):
        speed = 145_000.0 * (0.31 if c["amp_dtype"] == "bfloat16" else 1.0)
        speed *= 2.0 if c["compile_mode"] == "reduce-overhead" else 1.0
        return {"status": "ok", "samples_per_s": speed, "metric_drop": 0.0, "bound": "compute-bound"}

    study = _run_cuda(space, {k: result(c) for k, c in configs_of(space).items()}, 3)
    configs = [t.user_attrs["config"] for t in _measured(study)]
    assert {"compile_mode": "reduce-overhead", "amp_dtype": "float32"}.items() <= configs[2].items(), configs
    assert _best_config(study)["compile_mode"] == "reduce-overhead"


def test_the_compile_lever_takes_the_default_modes_first_and_the_others_only_without_them():
    names = {
        ("none", "default", "reduce-overhead"): [{"compile_mode": "default"}],
        ("none", "max-autotune", "max-autotune-no-cudagraphs"): [{"compile_mode": "max-autotune-no-cudagraphs"}],
        ("none",): None,
    }
    for modes, wanted in names.items():
        found = {lever.name: list(lever.variants) for lever in Staged(space_of({"compile_mode": list(modes)}),
                                                                      ["throughput"], "cuda", 16).levers}  # fmt: skip
        assert found.get("compile_mode") == wanted, (modes, found)


def _compiled_text(c):
    """Trimmed, grouped padding doubles the speed; a static compile over its many widths
    recompiles past dynamo's limit and costs 40%, shapes as symbols gain 30%; over as-given
    padding (one width) either compile gains 10%."""
    x = _independent(c)
    if c["compile_mode"] == "none":
        return x
    if c["padding"] == "as_given":
        return 1.1 * x
    return x * (1.3 if c["compile_dynamic"] else 0.6)


def test_with_many_lengths_and_trimmed_padding_compile_is_screened_with_shapes_as_symbols_first():
    values = {**SPACE, "compile_mode": ["none", "default"], "compile_dynamic": [False, True]}
    space, table = _table(_compiled_text, values)
    lever = next(lever for lever in Staged(space, ["throughput"]).levers if lever.name == "compile_mode")
    assert lever.variants[0] == {"compile_mode": "default", "compile_dynamic": True}
    assert {"compile_mode": "default"} in lever.variants[1:]  # the static compile stays, after it
    study, _ = _run(space, table, 6)
    configs = _configs_of(study)
    compiled = [c for c in configs if c["compile_mode"] != "none"]
    assert compiled and compiled[0]["compile_dynamic"], [Config(c).key() for c in configs]
    best = _best_config(study)
    assert best["compile_dynamic"] and best["padding"] == "trim", best
    # Samples of one length, nothing to trim: no shapes to make symbols of; the compile is static.
    one_width = space_of({"compile_mode": ["none", "default"], "compile_dynamic": [False, True]})
    variants = next(
        lever for lever in Staged(one_width, ["throughput"]).levers if lever.name == "compile_mode"
    ).variants
    assert variants[0] == {"compile_mode": "default"}


def test_a_runtime_slow_at_one_precision_is_still_tried_at_another():
    """Real text on a 2-core CPU: OpenVINO float32 ran 0.64x of the composed best, and its int8
    (7x the plain loop when tried by hand) was then refused unmeasured, as 'left out after
    screening'. A runtime is left out only at the precision it was measured with."""
    values = {"padding": ["as_given", "trim"], "length_grouping": [0, 16], "batch_size": [32, 128],
              "runtime": ["torch", "openvino"], "ov_precision": ["fp32", "int8_static"], "int8_fallback": [0, "auto"]}  # fmt: skip

    def speed(c):
        x = 100.0 * (2.0 if c["padding"] == "trim" and c["length_grouping"] else 1.0)
        if c["runtime"] == "openvino":
            x *= 3.0 if c["ov_precision"] == "int8_static" else 0.6
        return x

    space, table = _table(speed, values)
    study, _ = _run(space, table, 10)
    refused = [t.user_attrs for t in study.trials if t.user_attrs.get("kind") == "screened"]
    assert not [r for r in refused if r["config"]["ov_precision"] == "int8_static"], refused
    assert _best_config(study)["ov_precision"] == "int8_static"


def test_a_runtime_that_replaces_autocast_is_tried_on_a_recipe_holding_it():
    """Real MiniLM text on 2 cores with AVX-512 bf16 units and VNNI: the recipe (trimmed, grouped,
    bf16 autocast) ran 7.1x, and 16 trials never tried OpenVINO (9.1x with its bf16 hint, 13x in
    NNCF int8 on the same batches) nor any int8, since each masks autocast. A costly build that
    replaces a part of the composition is tried in that part's place."""
    values = {"padding": ["as_given", "trim"], "length_grouping": [0, 16], "batch_size": [32, 64],
              "amp_dtype": ["float32", "bfloat16"], "runtime": ["torch", "openvino"],
              "ov_precision": ["fp32", "bf16", "int8_static"], "int8_fallback": [0, "auto"],
              "compile_mode": ["none", "default"]}  # fmt: skip

    def speed(c):
        x = 100.0 * (2.6 if c["padding"] == "trim" and c["length_grouping"] else 1.0)
        if c["runtime"] == "openvino":
            return x * {"fp32": 2.0, "bf16": 3.5, "int8_static": 5.0}[c["ov_precision"]]
        return x * (2.7 if c["amp_dtype"] == "bfloat16" else 1.0) * (1.06 if c["compile_mode"] == "default" else 1.0)

    space, table = _table(speed, values)
    study, _ = _run(space, table, 10)
    configs = _configs_of(study)
    # A compile, which OpenVINO masks, replaces nothing: it is not built alone on the user's batches.
    assert not [c for c in configs if c["compile_mode"] != "none" and c["padding"] == "as_given"], configs
    ov = [c for c in configs if c["runtime"] == "openvino"]
    assert ov and all(c["padding"] == "trim" and c["length_grouping"] for c in ov), configs
    # float32 composed onto the trimmed batches is the configuration screening would measure
    # alone; the lever still goes on to its bf16, before int8 replaces it.
    assert [c["ov_precision"] for c in ov][:3] == ["fp32", "bf16", "int8_static"], ov
    best = _best_config(study)
    assert (best["runtime"], best["ov_precision"], best["padding"]) == ("openvino", "int8_static", "trim"), best


def test_a_costly_build_that_leads_is_tried_at_its_own_batch_neighbours():
    """Real MiniLM text: OpenVINO int8 led at 19x, and only the cheap best's batch neighbours
    (bf16 autocast at 16 and 64) were tried; OpenVINO int8 ran 7% faster at 64 than at 32."""
    values = {"padding": ["as_given", "trim"], "length_grouping": [0, 16], "batch_size": [16, 32, 64, 128],
              "amp_dtype": ["float32", "bfloat16"], "runtime": ["torch", "openvino"],
              "ov_precision": ["fp32", "int8_static"], "int8_fallback": [0, "auto"]}  # fmt: skip

    def speed(c):
        x = 100.0 * (2.6 if c["padding"] == "trim" and c["length_grouping"] else 1.0)
        if c["runtime"] == "openvino":
            x *= {"fp32": 2.0, "int8_static": 5.0}[c["ov_precision"]]
            return x * {16: 0.9, 32: 1.0, 64: 1.07, 128: 0.8}[c["batch_size"]]
        return (
            x
            * (2.7 if c["amp_dtype"] == "bfloat16" else 1.0)
            * {16: 0.97, 32: 1.0, 64: 0.95, 128: 0.7}[c["batch_size"]]
        )

    # The batch lever (4x the user's batch: 128) on OpenVINO int8 ran slower; 64 was never tried.
    space, table = _table(speed, values)
    study, _ = _run(space, table, 10)
    best = _best_config(study)
    assert (best["runtime"], best["ov_precision"], best["batch_size"]) == ("openvino", "int8_static", 64), best


def test_a_leading_runtimes_own_batch_neighbours_come_before_the_second_tier():
    """A 3-minute budget on real MiniLM text (2 cores): bf16 autocast measured 5% faster at a
    batch of 64 than at 32 (within the noise), OpenVINO bf16 was built on 64 and led, and the
    budget's last trials went to one thread and loader workers on the torch composition (each
    0.4-0.5x), not to OpenVINO at 32, which ran 5% faster: the pick re-timed at 0.95 of the
    16-trial winner. The leading runtime's own batch neighbours are measured first."""
    values = {"padding": ["as_given", "trim"], "length_grouping": [0, 16], "batch_size": [16, 32, 64, 128],
              "amp_dtype": ["float32", "bfloat16"], "runtime": ["torch", "openvino"],
              "ov_precision": ["fp32", "bf16"], "num_threads": [1, 2], "num_workers": [0, 2]}  # fmt: skip

    def speed(c):
        x = 100.0 * (2.6 if c["padding"] == "trim" and c["length_grouping"] else 1.0)
        x *= 0.5 if c["num_threads"] == 1 else 1.0
        x *= 0.45 if c["num_workers"] else 1.0
        if c["runtime"] == "openvino":
            x *= {"fp32": 0.8, "bf16": 1.5}[c["ov_precision"]]
            return x * {16: 0.88, 32: 1.05, 64: 1.0, 128: 0.6}[c["batch_size"]]
        x *= 1.25 if c["amp_dtype"] == "bfloat16" else 1.0
        return x * {16: 0.9, 32: 1.0, 64: 1.05, 128: 0.7}[c["batch_size"]]

    space, table = _table(speed, values)
    study, _ = _run(space, table, 16)
    configs = _configs_of(study)
    second = [i for i, c in enumerate(configs) if c["num_threads"] == 1 or c["num_workers"]]
    own = [i for i, c in enumerate(configs) if c["runtime"] == "openvino" and c["ov_precision"] == "bf16"
           and c["batch_size"] == 32]  # fmt: skip
    assert own and (not second or own[0] < second[0]), [Config(c).key() for c in configs]
    best = _best_config(study)
    assert (best["runtime"], best["ov_precision"], best["batch_size"]) == ("openvino", "bf16", 32), best


def test_a_runtime_near_a_lucky_cheap_best_is_tried_at_its_own_batch_neighbours():
    """2 cores with AMX, real MiniLM text: bf16 autocast measured 1.5x its usual speed at a batch
    of 64, twice in one day (774 and 863 samples/s; 418-564 in other runs). The costly builds
    went onto that batch, OpenVINO int8 ran 0.81-0.87 of the lucky figure there, and it was
    never tried at 32, where it ran 5.5-6.9x the baseline in every other run: those runs shipped
    bf16 at 3.3-3.7x. A build of another runtime near the cheap best has its own batch
    neighbours measured, as one that leads does."""
    values = {"padding": ["as_given", "trim"], "length_grouping": [0, 16], "batch_size": [16, 32, 64, 128],
              "amp_dtype": ["float32", "bfloat16"], "runtime": ["torch", "openvino"],
              "ov_precision": ["fp32", "bf16", "int8_static"], "int8_fallback": [0, "auto"]}  # fmt: skip

    def speed(c):
        x = 100.0 * (2.6 if c["padding"] == "trim" and c["length_grouping"] else 1.0)
        if c["runtime"] == "openvino":
            x *= {"fp32": 2.0, "bf16": 3.0, "int8_static": 4.5}[c["ov_precision"]]
            return x * {16: 0.85, 32: 1.0, 64: 0.75, 128: 0.6}[c["batch_size"]]
        x *= 2.7 if c["amp_dtype"] == "bfloat16" else 1.0
        return x * {16: 0.9, 32: 1.0, 64: 1.5, 128: 0.7}[c["batch_size"]]  # 64: the lucky figure

    space, table = _table(speed, values)
    study, _ = _run(space, table, 16)
    configs = _configs_of(study)
    # The costly builds went onto the lucky batch first, as before: that is what the figures said.
    assert any(c["runtime"] == "openvino" and c["batch_size"] == 64 for c in configs), configs
    best = _best_config(study)
    assert (best["runtime"], best["ov_precision"], best["batch_size"]) == ("openvino", "int8_static", 32), best


def test_a_compile_fixed_on_trims_padding_with_shapes_as_symbols():
    """fix={"compile_mode": "default"} over token sequences: a static compile of trimmed padding
    builds each width anew until dynamo's recompile limit (80 s of a 100-s trial of real MiniLM
    text on 2 cores), so the padding lever, and the recipe with it, trims with shapes as symbols."""
    from autotune.knobs import REGISTRY
    from autotune.search.space import SearchSpace

    base = {n: k.default for n, k in REGISTRY.items()} | {"num_threads": 2}
    values = {n: [v] for n, v in base.items()} | {
        "padding": ["as_given", "trim"],
        "length_grouping": [0, 16],
        "batch_size": [32, 128],
        "amp_dtype": ["float32", "bfloat16"],
        "compile_mode": ["default"],
        "compile_dynamic": [False, True],
    }
    staged = Staged(SearchSpace(values, base, {}), ["throughput"])
    padding = next(lever for lever in staged.levers if lever.name == "padding")
    assert padding.variants[0] == {"padding": "trim", "length_grouping": 16, "compile_dynamic": True}
    recipe = staged.recipe()
    assert (recipe["padding"], recipe["compile_mode"], recipe["compile_dynamic"]) == ("trim", "default", True)
    # Taking trimming back out keeps the symbols: the user's own widths would compile one by one.
    ablation = staged._ablations({staged.baseline_key: 100.0, Config(recipe).key(): 200.0})[0]
    assert (ablation["padding"], ablation["compile_dynamic"]) == ("as_given", True)
    # With compile a lever of its own, padding is trimmed alone (compile is screened with symbols).
    values["compile_mode"] = ["none", "default"]
    padding = next(
        lever for lever in Staged(SearchSpace(values, base, {}), ["throughput"]).levers if lever.name == "padding"
    )
    assert padding.variants[0] == {"padding": "trim", "length_grouping": 16}


def test_every_compile_built_onto_trimmed_padding_takes_shapes_as_symbols():
    """Real text: a compile with symbols did not pay on the trimmed composition, and the search
    went on to a static compile (89 s of recompiles, one width after another) and then a frozen
    static one. Onto trimmed padding, a compile takes shapes as symbols, and one that ran without
    paying is not built again in its other modes."""
    values = {**SPACE, "compile_mode": ["none", "default", "default-freezing"], "compile_dynamic": [False, True]}

    def speed(c):
        x = _independent(c)
        if c["compile_mode"] == "none":
            return x
        return x * (1.05 if c["padding"] == "as_given" else 1.0 if c["compile_dynamic"] else 0.6)

    space, table = _table(speed, values)
    study, _ = _run(space, table, 16)
    configs = _configs_of(study)
    trimmed = [c for c in configs if c["compile_mode"] != "none" and c["padding"] != "as_given"]
    assert trimmed and all(c["compile_dynamic"] for c in trimmed), [Config(c).key() for c in configs]
    assert {c["compile_mode"] for c in trimmed} == {"default"}


@pytest.mark.parametrize("compile_pays", [False, True])
def test_refinement_varies_the_cheap_knobs_eagerly_and_compiles_only_a_better_cheap_one(compile_pays):
    """Pre-padded real text: after the staged phases, the sampler proposed static and
    max-autotune compiles of batch and padding variants (28-60 s each), none near the best; then
    the batch neighbours and refinement trials of a compiled best were each a compile (13-49 s,
    217 s in all), none near it. Refinement varies the cheap knobs without a compile, and the
    best's compile is built again only on a cheap configuration measured faster than the one it
    was built on."""
    values = {**SPACE, "compile_mode": ["none", "default", "max-autotune-no-cudagraphs"], "batch_size": [16, 32, 64]}

    def speed(c):
        x = _independent(c)
        return x * (
            1.2 if compile_pays and c["compile_mode"] == "default" else 0.9 if c["compile_mode"] != "none" else 1
        )

    space, table = _table(speed, values)
    study, _ = _run(space, table, 16)
    measured = _measured(study)
    best = max(measured, key=lambda t: t.value)
    staged = ("recipe", "screen", "compose")
    refined = [t for t in measured if not t.user_attrs.get("baseline") and t.user_attrs.get("phase") not in staged]
    assert len(refined) >= 2, [t.user_attrs.get("phase") for t in measured]
    assert {t.user_attrs["config"]["compile_mode"] for t in refined} == {"none"}
    assert best.user_attrs["config"]["compile_mode"] == ("default" if compile_pays else "none")
    # A compile after the first is the same compile on a cheap configuration that ran faster eagerly.
    compiled = [t for t in measured if t.user_attrs["config"]["compile_mode"] != "none"]
    speed_of = {t.user_attrs["key"]: t.value for t in measured}
    for t in compiled[1:] if compile_pays else []:
        eager = Config({**t.user_attrs["config"], "compile_mode": "none"}).key()
        first = Config({**compiled[0].user_attrs["config"], "compile_mode": "none"}).key()
        assert t.user_attrs["config"]["compile_mode"] == "default" and speed_of[eager] > speed_of[first]
    # The cheap knobs still vary around it.
    cheap = ("batch_size", "num_threads", "amp_dtype", "padding", "length_grouping")
    assert len({tuple(t.user_attrs["config"][k] for k in cheap) for t in refined}) >= 2


def test_a_costly_lever_waits_for_the_cheap_ones_and_is_built_once_on_their_best():
    """Pre-padded real text on a CPU without 16-bit units: trimmed padding alone paid 2.9x, and
    compile was then screened alone on the untrimmed batches (40 s for 1.1x), and every
    second-tier trial after it (batch, threads) compiled again (20-50 s each, against 10 s
    eager). Compile now waits for the cheap levers, and is built once on their best."""
    values = {**SPACE, "amp_dtype": ["float32"], "compile_mode": ["none", "default"], "compile_dynamic": [False, True]}

    def speed(c):
        x = _independent(c) * (1.15 if c["compile_mode"] == "default" else 1.0)
        return x * (1.05 if c["batch_size"] == 64 else 1.0)

    space, table = _table(speed, values)
    study, _ = _run(space, table, 8)
    configs = _configs_of(study)
    phases = [t.user_attrs.get("phase") for t in _measured(study)]
    compiled = [i for i, c in enumerate(configs) if c["compile_mode"] != "none"]
    assert compiled, [Config(c).key() for c in configs]
    staged = [i for i in compiled if phases[i] in ("screen", "compose")]
    assert all(configs[i]["padding"] == "trim" for i in staged), "compile was screened on the untrimmed batches"
    first = configs[compiled[0]]
    # Built on the best cheap composition: the second tier (the larger batch) came before it.
    assert first["batch_size"] == 64 and first["compile_dynamic"], first
    assert not [c for c in configs[: compiled[0]] if c["compile_mode"] != "none"]
    assert _best_config(study)["compile_mode"] == "default"


def test_refinement_builds_around_the_quickest_of_a_tie_not_a_compile_within_the_noise():
    """Real text: a frozen compile measured 0.5% faster than the eager best, and every refinement
    trial after it was a 50-s compile. A tie within the noise is built around its quickest."""
    values = {**SPACE, "compile_mode": ["none", "default-freezing"]}
    space, _ = _table(_independent, values)
    staged = Staged(space, ["throughput"])

    def record(compile_mode, speed, compile_s):
        config = staged._full({"padding": "trim", "length_grouping": 16, "compile_mode": compile_mode})
        return {"key": Config(config).key(), "config": config, "status": "ok", "samples_per_s": speed,
                "compile_s": compile_s}  # fmt: skip

    base = {"key": staged.baseline_key, "config": staged.baseline, "status": "ok", "samples_per_s": 70.0}
    tie = [base, record("none", 205.6, 0.4), record("default-freezing", 206.6, 45.0)]
    assert staged.held(tie)["compile_mode"] == "none"
    # A compile well ahead: refinement still varies the cheap knobs without it, and the compile
    # is built once more on a cheap configuration that beats the one it was built on.
    ahead = [base, record("none", 205.6, 0.4), record("default-freezing", 240.0, 45.0)]
    assert staged.held(ahead)["compile_mode"] == "none"
    larger = staged._full({"padding": "trim", "length_grouping": 16, "batch_size": 64})
    ahead.append({"key": Config(larger).key(), "config": larger, "status": "ok", "samples_per_s": 230.0})
    tied = [*ahead[:-1], {**ahead[-1], "samples_per_s": 206.6}]
    assert staged._interactions(tied, staged._scores(tied), []) is None  # within the noise: not built again
    lifted = staged._interactions(ahead, staged._scores(ahead), [])
    assert lifted == {**larger, "compile_mode": "default-freezing"}, lifted


def test_training_in_two_ranks_is_screened_with_the_micro_batch_split_between_them():
    """A step's samples split over the ranks: the baseline's micro-batch (the whole effective
    batch) would not divide a rank's share, so the lever halves it first."""
    from autotune.search.levers import levers

    space = space_of({"batch_size": [16, 32, 64], "world_size": [1, 2], "optimizer_impl": ["default", "fused"]})
    space.baseline.update(batch_size=64)
    found = {lever.name: lever.variants for lever in levers(space, 2, "cpu")}
    assert found["world_size"] == ({"world_size": 2, "batch_size": 32},)


def test_a_trial_refused_for_time_counts_as_failed_until_its_requeue_is_measured():
    """The screening moves on past a lever refused for the deadline; once the lever is queued
    again and measured (search.limits.requeue_refused), its measurement is its score."""
    space = space_of(SPACE)
    staged = Staged(space, ["throughput"])
    refused = {"key": "k", "status": "timeout", "kind": "deadline", "ran": False}
    measured = {"key": "k", "status": "ok", "ran": True, "samples_per_s": 250.0, "metric_drop": 0.0}
    assert staged._scores([refused]) == {"k": None}
    assert staged._scores([refused, measured]) == {"k": 250.0}


def test_the_next_configurations_do_not_depend_on_the_trial_budget():
    """Under a budget, a user who sets n_trials=200 gets the order a 16-trial run gets: what comes
    next depends on the records (and, in the study loop, the time left), not on the trial count."""
    space, table = _table(_independent)
    study, _ = _run(space, table, 3)
    records = [t.user_attrs for t in _measured(study)]
    staged = Staged(space, ["throughput"])
    assert staged.next_configs(records, 16) == staged.next_configs(records, 200)


def test_under_a_deadline_the_costly_builds_go_before_a_batch_climb_that_would_crowd_them_out():
    """A 3-minute budget of real MiniLM climbed the batch to 64, 128 and 256 (+10%, 31 s) before
    its costly builds, and ended on OpenVINO's float build, before the bf16 one that ran 1.5x.
    Where the batch's next step and the builds to come do not all fit in the time left, the
    builds come first; where they fit (or without a deadline) the batch is climbed first."""

    def speed(c):
        return _independent(c) * (1.3 if c["compile_mode"] == "default" else 1.0)

    space, table = _table(speed, {**SPACE, "compile_mode": ["none", "default"]})
    study, _ = _run(space, table, 4)  # the baseline, the recipe and its two ablations
    records = [t.user_attrs for t in _measured(study)]
    staged = Staged(space, ["throughput"])
    _, [free] = staged.next_configs(records, 16)
    assert (free["batch_size"], free["compile_mode"]) == (64, "none")
    priced = []

    def fits(configs):
        priced.append([(c["batch_size"], c["compile_mode"]) for c in configs])
        return True

    assert staged.next_configs(records, 16, afford=fits)[1] == [free]
    assert priced == [[(64, "none"), (32, "default")]]  # the climb's step, then the compile on the recipe
    _, [tight] = staged.next_configs(records, 16, afford=lambda configs: False)
    assert (tight["batch_size"], tight["compile_mode"], tight["padding"]) == (32, "default", "trim"), tight


def test_what_fits_under_a_deadline_is_priced_from_the_trials_measured():
    import time

    from autotune.search.limits import _Limits

    limits = _Limits(TableRunner({}), None, time.monotonic() + 30.0, 30.0)
    assert limits.afford([]) is None  # nothing is priced before the baseline's trial
    limits.baseline = {"config": {"compile_mode": "none", "batch_size": 8}, "ran": True, "wall_s": 2.0}
    afford = limits.afford([limits.baseline])
    cheap, compiled = {"compile_mode": "none", "batch_size": 32}, {"compile_mode": "default", "batch_size": 8}
    assert afford([cheap, compiled])  # 2 s and a compile's prior (22 s) fit in 30
    assert not afford([cheap, compiled, compiled])
    assert _Limits(TableRunner({}), None, None, None).afford([]) is None  # no deadline, no limit


def _registered(cls):
    """``cls`` registered while a test runs, its name given to the test, and gone after it."""
    from autotune.knobs import REGISTRY, register

    register(cls)
    try:
        yield cls.name
    finally:
        del REGISTRY[cls.name]


@pytest.fixture
def new_knob():
    """A knob added the way a contributor adds one: its own class, registered, declaring its lever."""
    from autotune.knobs import Knob, Stage

    class FastPath(Knob):
        name = "test_fast_path"
        stage = Stage.RUNTIME
        choices = (False, True)
        default = False
        help = "a test's knob: a path that doubles the speed"
        screen = (True,)
        screen_rank = 45  # after autocast
        first_tier = True

        def apply(self, state, value):
            pass

    yield from _registered(FastPath)


def test_a_new_knob_declaring_its_lever_is_screened_with_nothing_else_naming_it(new_knob):
    """A knob in a module of its own (here, this test's) that declares its lever: the levers put
    it where its rank says, the search tries it (alone in the first tier, or on the recipe it
    builds on) and keeps it where it pays."""
    from autotune.search.levers import levers

    values = {"amp_dtype": ["float32", "bfloat16"], new_knob: [False, True], "batch_size": [32, 64]}
    space = space_of(values)
    assert [lever.name for lever in levers(space)] == ["amp_dtype", new_knob, "batch_size"]
    assert next(lever for lever in levers(space) if lever.name == new_knob).variants == ({new_knob: True},)

    def speed(c):
        return 100.0 * (2.0 if c[new_knob] else 1.0) * (1.2 if c["amp_dtype"] == "bfloat16" else 1.0)

    space, table = _table(speed, values)
    study, _ = _run(space, table, 4)
    # The recipe (autocast and a larger batch) paid; the new lever is tried on it, in the composition.
    tried = [(t.user_attrs.get("phase"), t.user_attrs["config"][new_knob]) for t in _measured(study)]
    assert ("compose", True) in tried, tried
    assert _best_config(study)[new_knob] is True
    # Without a recipe to build on, the first tier screens it alone on the baseline.
    space, table = _table(speed, {new_knob: [False, True], "num_threads": [1, 2]})
    study, _ = _run(space, table, 3)
    assert ("screen", True) in [(t.user_attrs.get("phase"), t.user_attrs["config"][new_knob]) for t in _measured(study)]


@pytest.fixture
def declared_knob():
    """A knob that declares what the rest of autotune asks of every knob: the half it changes,
    that it changes a batch's memory and which code runs, and that naming it chooses a runtime."""
    from autotune.knobs import Knob, Stage

    class Feeder(Knob):
        name = "test_feeder"
        stage = Stage.LOADER
        choices = (False, True)
        default = False
        side, memory, code, deploy = "loader", True, "path", True

        def apply(self, state, value):
            pass

    yield from _registered(Feeder)


def test_a_new_knobs_declarations_reach_the_diagnosis_the_failure_rules_and_the_space_note(declared_knob):
    """Nothing outside the knob names it: the diagnosis counts it on the loader's side, a larger
    batch is not tried where its value ran out of memory, a code path that failed twice with its
    value is not tried a third time, and naming it in ``fix`` is choosing the runtimes."""
    import optuna

    from autotune.config import Config
    from autotune.run.hints import space_note
    from autotune.run.options import Options
    from autotune.search.record import _fault_rule, _oom_rule
    from autotune.trial.diagnose import explain

    base_cfg = dict(Config({"batch_size": 32, declared_knob: False}))
    best_cfg = dict(Config({"batch_size": 32, declared_knob: True}))
    baseline = {"loader_samples_per_s": 400.0, "model_samples_per_s": 2900.0, "bound": "data-bound"}
    best = {"loader_samples_per_s": 3100.0, "model_samples_per_s": 2950.0, "bound": "balanced"}
    assert f"{declared_knob}=True raised the loader" in explain(baseline, best, base_cfg, best_cfg)

    study = optuna.create_study(storage="sqlite:///:memory:")
    for config, status in (({**best_cfg, "batch_size": 64}, "oom"), (best_cfg, "error"), (best_cfg, "error")):
        trial = study.ask()
        for key, value in {
            "status": status,
            "kind": status if status == "oom" else "runtime",
            "config": config,
        }.items():
            trial.set_user_attr(key, value)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    oom = _oom_rule({**best_cfg, "batch_size": 128}, study.trials)
    assert oom is not None and f"{declared_knob}=True" in oom
    assert _oom_rule({**base_cfg, "batch_size": 128}, study.trials) is None  # its other value: another batch's memory
    assert _fault_rule({**best_cfg, "batch_size": 8}, study.trials) is not None
    assert _fault_rule({**base_cfg, "batch_size": 8}, study.trials) is None

    assert space_note(Options(device="cpu")) is not None
    assert space_note(Options(device="cpu", fix={declared_knob: True})) is None


def test_under_a_deadline_the_build_that_promises_most_per_second_goes_first():
    """A 90-s budget of real MiniLM after a 16-trial run queued the compile first (priced 59 s),
    refused it and OpenVINO's int8 for time, and ended on plain PyTorch at 0.58 of the 16-trial
    winner. Under a deadline the costly builds go by expected gain per second, from what the
    runs before measured of each kind (unmeasured ones from one prior: the cheapest first);
    without a deadline their order is the space's."""
    from autotune.search.limits import Afford

    def speed(c):
        gain = {"default": 1.0}.get(c["compile_mode"], 1.0) * (1.6 if c["quantization"] == "int8_dynamic" else 1.0)
        return _independent(c) * gain

    values = {
        **SPACE,
        "batch_size": [32],
        "compile_mode": ["none", "default"],
        "quantization": ["none", "int8_dynamic"],
    }
    space, table = _table(speed, values)
    study, _ = _run(space, table, 4)  # the baseline, the recipe and its two ablations
    records = [t.user_attrs for t in _measured(study)]
    staged = Staged(space, ["throughput"])

    def built(afford):
        _, [config] = staged.next_configs(records, 16, afford=afford)
        return [k for k in ("compile_mode", "quantization") if config[k] != space.baseline[k]]

    seconds = {"compile_mode": 25.0, "quantization": 9.0}

    def cost(config):
        return sum(s for k, s in seconds.items() if config[k] != space.baseline[k]) + 2.0

    assert built(None) == ["compile_mode"]  # the space's order
    past = {
        "compile_mode=default": {"extra_s": 23.0, "ratio": 1.0},
        "quantization=int8_dynamic": {"extra_s": 7.0, "ratio": 1.6},
    }
    assert built(Afford(1e9, cost, past)) == ["quantization"]
    # Measured by no run before: the cheaper build first.
    assert built(Afford(1e9, cost, {})) == ["quantization"]
    seconds.update(compile_mode=4.0)
    assert built(Afford(1e9, cost, {})) == ["compile_mode"]
    # The compile measured no faster before: after the int8 build, although cheaper.
    assert built(Afford(1e9, cost, past)) == ["quantization"]


def test_loader_workers_that_lost_beside_the_plain_model_are_tried_again_beside_a_faster_runtime():
    """One pass over 160 real photos on 2 cores (the trials of a 10-trial run): the drafted decode
    ran 82 samples/s, 2 workers beside it 77 and were dropped, OpenVINO on the drafted decode 96,
    and the run shipped that; 2 workers beside OpenVINO ran 131 (138 in int8), which a run that
    kept the workers found."""
    values = {"batch_size": [32, 64], "jpeg_draft": [False, True], "num_workers": [0, 2], "num_threads": [1, 2],
              "runtime": ["torch", "openvino"], "ov_precision": ["fp32", "int8_static"],
              "int8_fallback": [0, "auto"]}  # fmt: skip
    rates = {("torch", False): (42, 59), ("torch", True): (82, 77), ("openvino", False): (45, 70),
             ("openvino", True): (96, 131), ("int8", False): (44, 72), ("int8", True): (93, 138)}  # fmt: skip

    def speed(c):
        kind = "int8" if c["runtime"] == "openvino" and c["ov_precision"] == "int8_static" else c["runtime"]
        alone, beside = rates[(kind, c["jpeg_draft"])]
        if c["num_workers"]:
            x = beside if c["num_threads"] == 1 else beside * 0.5  # 2 threads beside 2 workers: 3 on 2 cores
        else:
            x = alone if c["num_threads"] == 2 else alone * 0.65
        return x * (0.97 if c["batch_size"] == 64 else 1.0)

    space, table = _table(speed, values)
    study, _ = _run(space, table, 10)
    best = _best_config(study)
    assert (best["runtime"], best["jpeg_draft"], best["num_workers"]) == ("openvino", True, 2), [
        Config(c).key() for c in _configs_of(study)
    ]
