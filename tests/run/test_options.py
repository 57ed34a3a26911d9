"""Options: every keyword of optimize(), validated once; the CLI builds the same object."""

import inspect

import pytest

import autotune
from autotune.run.options import Options


def test_optimize_takes_exactly_the_options():
    params = list(inspect.signature(autotune.optimize).parameters)
    assert params[:2] == ["model", "dataset"]
    assert params[2:] == Options.names()
    defaults = {
        n: p.default for n, p in inspect.signature(autotune.optimize).parameters.items() if n in Options.names()
    }
    # optimize() resolves these before Options holds them: the export formats, progress (True:
    # the display on stderr) into the display object, and the bound of a run given none (30
    # trials within a 10-minute budget).
    resolved = {"export": None, "progress": True, "n_trials": None, "budget": None}
    assert defaults == {n: getattr(Options(), n) for n in Options.names() if n not in resolved} | resolved


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_trials": 0}, "`n_trials` must be a positive integer"),
        ({"max_metric_drop": 1.5}, "`max_metric_drop` must be in \\[0, 1\\]"),
        ({"export": ["pickle"]}, "No export format named 'pickle'"),
        ({"measure": {"n_window": 3}}, "`measure` takes n_windows"),
        ({"mode": "serve"}, "`mode` must be 'inference' or 'train'"),
    ],
)
def test_bad_options_fail_once_with_what_to_fix(changes, message):
    with pytest.raises(autotune.ConfigError, match=message):
        Options(**changes)


def test_options_are_frozen_and_replace_validates_again():
    opts = Options(n_trials=3)
    with pytest.raises(AttributeError):
        opts.n_trials = 4
    assert opts.replace(n_trials=4).n_trials == 4
    with pytest.raises(autotune.ConfigError):
        opts.replace(n_trials=-1)


def test_cfg_then_flags_override_in_order():
    cfg = {
        "model": None,
        "dataset": None,
        "options": {"n_trials": 5, "fix": {"amp_dtype": "float32"}},
        "space": "quick",
    }
    opts = Options.from_cfg(cfg, {"n_trials": 9, "space": None, "fix": {"num_threads": 1}})
    assert opts.n_trials == 9 and opts.space == "quick" and opts.fix == {"amp_dtype": "float32", "num_threads": 1}
    with pytest.raises(autotune.ConfigError, match=r"Unknown option 'n_trial' in cfg\.py's options\. Known: "):
        Options.from_cfg({"options": {"n_trial": 5}}, {})


def test_join_without_a_shared_storage_is_refused_in_one_line():
    # Each worker would open its own out_dir's study.db: as many searches as machines, none shared.
    with pytest.raises(autotune.ConfigError, match="no `storage` was given") as refused:
        Options(join=True)
    message = str(refused.value)
    assert "\n" not in message and "--storage" in message and "--join" in message
    assert Options(join=True, storage="sqlite:///shared.db").join
    with pytest.raises(autotune.ConfigError, match="no `storage` was given"):
        Options(storage="sqlite:///shared.db").replace(join=True, storage=None)


# The command line's flags, by the option each sets (where the names differ).
CLI_NAMES = {"trials": "n_trials", "out": "out_dir", "study": "study_name", "heartbeat": "heartbeat_interval_s",
             "grace": "grace_period_s", "no_profile": "profile"}  # fmt: skip
# Flags that set no option: what the command prints, and the cfg file itself.
CLI_ONLY = {"help", "cfg", "dry_run", "quiet", "verbose", "json", "debug"}
# Options a flag cannot carry (functions, objects, datasets, mappings): cfg.py defines them, at
# its top level or in its `options` dict (docs/cfg.md).
CFG_ONLY = {"metric", "max_metric_drop", "objectives", "baseline_batch_size", "n_val", "measure", "n_verify_pairs",
            "n_finalists", "select", "loss_fn", "train_dataset", "prune_ignore", "test_dataset", "sampler",
            "optimizer", "effective_batch_size", "allow_batch_change", "loss_tolerance", "n_train_steps",
            "progress", "output_kind", "collate_fn", "pad_values", "mode"}  # fmt: skip
# What a trial worker needs of the options: the rest (the study, the budget, the export) is the run's.
WORKER = {"metric", "device", "measure", "seed", "loss_fn", "train_dataset", "prune_ignore", "test_dataset",
          "max_metric_drop", "mode", "optimizer", "effective_batch_size", "n_train_steps", "loss_tolerance",
          "output_kind", "collate_fn"}  # fmt: skip


def test_the_options_the_cli_and_the_worker_spec_are_kept_in_step():
    """One declaration, Options, and two views of it: every flag of `autotune run` sets an option
    (or says how to print), every option is a flag or cfg.py's alone, and the worker's spec holds
    the options a trial reads under their own names. A new option lands in one of these lists."""
    import argparse
    import dataclasses

    from autotune.cli.run import _run_parser
    from autotune.trial.spec import WorkerSpec

    parser = argparse.ArgumentParser()
    _run_parser(parser)
    flags = {a.dest for a in parser._actions} - CLI_ONLY
    options = set(Options.names())
    assert {CLI_NAMES.get(f, f) for f in flags} <= options, "a flag that sets no option"
    assert options - {CLI_NAMES.get(f, f) for f in flags} == CFG_ONLY, "an option neither a flag nor cfg.py's"
    spec = {f.name for f in dataclasses.fields(WorkerSpec)}
    assert spec & options == WORKER
