"""Bad input ends in one clear line: a typed error from the API, exit code 2 from the CLI."""

import subprocess
import sys
import textwrap

import pytest
import torch

import autotune
from autotune.cli import main
from tests.models import MLP, classification_data

FAST = {"n_windows": 1, "window_s": 0.01, "warmup_batches": 1, "n_remeasure": 0}
GOOD_MODEL = "import torch\nmodel = torch.nn.Linear(4, 2)\n"
GOOD_DATA = "dataset = [torch.randn(4) for _ in range(16)]\n"

# (case, cfg.py source or None for a missing file, extra CLI args, expected message fragment)
CLI_CASES = [
    ("missing cfg", None, [], "does not exist"),
    ("syntax error", "model = (\n", [], "syntax error at line"),
    ("cfg raises", "raise RuntimeError('no data here')\n", [], "raised RuntimeError (line 1): no data here"),
    ("no model", "import torch\n" + GOOD_DATA, [], "must define model"),
    ("no dataset", GOOD_MODEL, [], "must define dataset"),
    ("model not a module", "import torch\nmodel = 42\n" + GOOD_DATA, [], "`model` must be a torch.nn.Module"),
    ("empty dataset", GOOD_MODEL + "dataset = []\n", [], "The dataset is empty"),
    ("sample not a tensor", GOOD_MODEL + "dataset = ['a', 'b']\n", [], "A sample must be a tensor"),
    (
        "inconsistent shapes",
        GOOD_MODEL + "dataset = [torch.randn(4)] * 8 + [torch.randn(5)]\n",
        [],
        "inconsistent shapes",
    ),
    ("iterable dataset", GOOD_MODEL + "dataset = iter([torch.randn(4)])\n", [], "map-style"),
    (
        "unknown preset",
        GOOD_MODEL + GOOD_DATA,
        ["--space", "gpux"],
        "No preset named 'gpux'. Known: cpu, cpu-deploy, default, gpu, quick, shrink",
    ),
    (
        "unknown knob",
        GOOD_MODEL + GOOD_DATA,
        ["--fix", "warp_speed=9"],
        "No knob named 'warp_speed'. Known: batch_size",
    ),
    (
        "invalid knob value",
        GOOD_MODEL + GOOD_DATA,
        ["--fix", "amp_dtype=float8"],
        "Knob 'amp_dtype' cannot be 'float8'",
    ),
    ("malformed fix", GOOD_MODEL + GOOD_DATA, ["--fix", "amp_dtype"], "--fix takes NAME=VALUE"),
    ("unrunnable fix", GOOD_MODEL + GOOD_DATA, ["--fix", "amp_dtype=float16"], 'Cannot fix amp_dtype="float16"'),
    ("bad trials", GOOD_MODEL + GOOD_DATA, ["--trials", "0"], "`n_trials` must be a positive integer"),
    (
        "bad drop",
        GOOD_MODEL + GOOD_DATA + "max_metric_drop = 1.5\n",
        [],
        "`max_metric_drop` must be in [0, 1], but got 1.5",
    ),
    ("unknown option", GOOD_MODEL + GOOD_DATA + "options = {'n_trails': 3}\n", [], "Unknown option 'n_trails'"),
    ("bad device", GOOD_MODEL + GOOD_DATA, ["--device", "tpu"], "`device` must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ("metric not callable", GOOD_MODEL + GOOD_DATA + "metric = 3\n", [], "`metric` must be a function"),
]


@pytest.mark.parametrize("case,source,args,expected", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, source, args, expected):
    cfg = tmp_path / "cfg.py"
    if source is not None:
        cfg.write_text(source)
    code = main(["run", str(cfg), "--out", str(tmp_path / "out"), "--trials", "1", *args])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: "), err
    assert expected in lines[0]
    assert "Traceback" not in err


def test_cli_unreadable_cfg_is_a_clear_error(tmp_path, capsys):
    assert main(["run", str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_forward_failure_shows_the_models_own_error(tmp_path):
    # A real worker process: the probe forward pass fails on the first batch.
    cfg = tmp_path / "cfg.py"
    cfg.write_text(
        textwrap.dedent("""
        import torch
        model = torch.nn.Linear(10, 2)          # expects 10 features
        dataset = [torch.randn(4) for _ in range(16)]  # gives 4
    """)
    )
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "run", str(cfg), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "forward pass failed on the first batch" in done.stderr
    assert "mat1 and mat2 shapes cannot be multiplied" in done.stderr
    assert "Traceback" not in done.stderr
    # --debug shows the traceback.
    debug = subprocess.run(
        [sys.executable, "-m", "autotune", "run", str(cfg), "--out", str(tmp_path / "d"), "--debug"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" in debug.stderr


API_CASES = [
    (dict(model="not a model"), autotune.InputError, "`model` must be a torch.nn.Module"),
    (dict(dataset=[]), autotune.InputError, "The dataset is empty"),
    (dict(dataset=[{"x": "text"}] * 2), autotune.InputError, "A sample must be a tensor"),
    (dict(dataset=[(torch.randn(4), 0, 1)] * 2), autotune.InputError, "(inputs, target) or (inputs,)"),
    (dict(n_trials=-1), autotune.ConfigError, "`n_trials` must be a positive integer"),
    (dict(timeout=0), autotune.ConfigError, "`timeout` must be a positive number"),
    (dict(max_metric_drop=-0.1), autotune.ConfigError, "`max_metric_drop` must be in [0, 1]"),
    (dict(isolation="thread"), autotune.ConfigError, "`isolation` must be 'subprocess' or 'inprocess'"),
    (dict(objectives=("speed",)), autotune.ConfigError, "No objective named 'speed'. Known: throughput"),
    (dict(space={"base": None, "batch_size": []}), autotune.ConfigError, "needs a non-empty list"),
    (dict(measure={"windows": 3}), autotune.ConfigError, "`measure` takes n_windows"),
    (dict(mode="eval"), autotune.ConfigError, "`mode` must be 'inference' or 'train'"),
    (dict(mode="train"), autotune.ConfigError, "Training mode needs `loss_fn"),
    (dict(space="nope.toml"), autotune.ConfigError, "does not exist"),
]


@pytest.mark.parametrize("override,error,expected", API_CASES, ids=[str(c[0])[:40] for c in API_CASES])
def test_api_bad_input_raises_typed_error(tmp_path, override, error, expected):
    args = dict(
        model=MLP(),
        dataset=classification_data(32),
        out_dir=tmp_path,
        device="cpu",
        measure=FAST,
        isolation="inprocess",
        n_trials=1,
    )
    args.update(override)
    with pytest.raises(error) as info:
        autotune.optimize(args.pop("model"), args.pop("dataset"), **args)
    assert expected in str(info.value)
    assert isinstance(info.value, autotune.AutotuneError) and isinstance(info.value, ValueError)


def test_unpicklable_model_error_says_what_to_do(tmp_path):
    import threading

    model = MLP()
    model.lock = threading.Lock()  # cannot be pickled
    with pytest.raises(autotune.InputError, match=r"Pass a zero-argument function.*cfg\.py.*isolation='inprocess'"):
        autotune.optimize(model, classification_data(32), out_dir=tmp_path, device="cpu", n_trials=1)


def test_a_factory_gets_round_an_unpicklable_model(tmp_path):
    import threading

    def build():
        model = MLP()
        model.lock = threading.Lock()
        return model

    result = autotune.optimize(
        build, classification_data(32), out_dir=tmp_path, device="cpu", n_trials=1, measure=FAST, space={"base": None}
    )
    assert result.baseline["samples_per_s"] > 0
