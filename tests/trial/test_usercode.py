"""User code travels: classes and functions written in a cfg.py, a script or a module loaded by
hand work in every process a run starts, compiled, and in a DataLoader's own workers there."""

import csv
import importlib.util
import io
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from autotune.config import Config
from autotune.run.cfg import load_config
from autotune.trial.usercode import UserPickler
from tests.trial.test_worker_start import _wait_ready

# The cfg: a model class of its own, as most users write one.
NET_CFG = """
import torch
from torch import nn

SCALE = 0.5

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 10)
    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * SCALE

def model():
    torch.manual_seed(0)
    return Net().eval()

_x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(0))
dataset = [(_x[i], 0) for i in range(len(_x))]
options = {"measure": {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}, "n_verify_pairs": 2}
"""

# A dataset class, a collate and a metric of the cfg's own, read by loader workers.
DATA_CFG = """
import torch
from torch import nn

class Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {"x": self.x[i], "label": self.y[i]}

def collate_fn(samples):
    return {"x": torch.stack([s["x"] for s in samples]), "label": torch.stack([s["label"] for s in samples])}

def metric(outputs, batch):
    return (outputs.argmax(-1) == batch["label"]).float().mean().item()

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    def forward(self, x):
        return self.f(x)

model = Head().eval()
dataset = Rows(512)
max_metric_drop = 1.0  # random weights: the accuracy is chance, and the test is that it is measured
options = {"measure": {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0}, "n_verify_pairs": 2}
"""


def _trials(out):
    with open(out / "trials.csv") as f:
        return list(csv.DictReader(f))


def _run(cfg, out, *flags):
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "run", str(cfg), "--out", str(out), "--device", "cpu", *flags],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_a_model_class_written_in_cfg_compiles_in_the_runs_trials(tmp_path):
    """Every compiled trial failed with "No module named '__autotune_cfg__'": the compiler
    imports a traced function's module by name, and the trial worker had none of that name."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(NET_CFG)
    out = tmp_path / "out"
    _run(cfg, out, "--trials", "2", "--fix", "compile_mode=default", "--fix", "batch_size=64", "--export", "none")
    rows = _trials(out)
    compiled = [r for r in rows if r.get("compile_mode") == "default"]
    assert compiled, rows
    assert all(r["status"] == "ok" for r in rows), [(r["status"], r["reason"]) for r in rows]


def test_a_cfg_dataset_collate_and_metric_work_in_loader_workers_and_the_claim(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(DATA_CFG)
    out = tmp_path / "out"
    _run(cfg, out, "--trials", "2", "--fix", "num_workers=2", "--export", "none")
    rows = _trials(out)
    assert all(r["status"] == "ok" for r in rows), [(r["status"], r["reason"]) for r in rows]
    claim = json.loads((out / "best_config.json").read_text())["speedup"]
    assert claim["verdict"] != "failed" and claim["n_rounds"] >= 1, claim["sentence"]


@pytest.mark.slow  # CI time: the `autotune run` compile test above runs the compiled case through a run's workers
@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_a_cfg_model_compiles_in_a_fresh_and_a_forked_worker(tmp_path, fork):
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.runner import SubprocessRunner
    from autotune.trial.spec import WorkerSpec, pickle_spec

    cfg = tmp_path / "cfg.py"
    cfg.write_text(NET_CFG)
    loaded = load_config(cfg)
    spec = WorkerSpec(
        model=loaded["model"], dataset=loaded["dataset"][:256], metric=None, device="cpu",
        baseline=dict(Config({"batch_size": 64})), val_indices=list(range(64)),
        measure=MeasureSettings(n_windows=1, window_s=0.02, warmup_batches=1, n_remeasure=0),
    )  # fmt: skip
    runner = SubprocessRunner(pickle_spec(spec), 300.0, tmp_path / "w.log", fork=fork)
    try:
        runner.run(dict(Config({"batch_size": 64})))  # the first worker; a forked one comes after
        if fork:
            _wait_ready(tmp_path / "w-server")  # until then, a restart starts a fresh interpreter
            runner.restart()
            assert type(runner._proc).__name__ == "_Forked"
        got = runner.run(dict(Config({"batch_size": 64, "compile_mode": "default"})))
    finally:
        runner.close()
    assert got.status == "ok", got.reason


def _by_hand(path):
    """A module loaded as notebooks and test harnesses do, never registered in sys.modules."""
    spec = importlib.util.spec_from_file_location("photo_cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHILD = """
import io, pickle, sys, torch
payload = sys.stdin.buffer.read()
dataset = pickle.loads(payload)
loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1, multiprocessing_context="{method}")
from autotune.trial.usercode import by_value_in_children
by_value_in_children()
print(float(sum(b.sum() for b in loader)))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_dataset_that_arrived_by_value_reaches_loader_workers_started_by_(tmp_path, method):
    """A worker holds the user's classes under names no other process can import; a DataLoader
    started there with spawn or forkserver pickled them by reference and failed ("it's not the
    same object as jpeg_cfg.PhotoFolder")."""
    path = tmp_path / "photo_cfg.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        class Photos(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return torch.full((3,), float(i))
        """)
    )
    dataset = _by_hand(path).Photos()
    buf = io.BytesIO()
    UserPickler(buf).dump(dataset)
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(method=method)], input=buf.getvalue(), capture_output=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert float(done.stdout.decode().split()[-1]) == 3 * sum(range(8))


def test_functions_arrive_with_their_globals_as_a_registered_module():
    namespace = {"__name__": "__autotune_test_cfg__", "__file__": "/x/cfg.py"}
    exec("import torch\nK = 3\ndef f(x):\n    return K * torch.sqrt(x)\ndef g(x):\n    return f(x) + 1", namespace)
    buf = io.BytesIO()
    UserPickler(buf).dump((namespace["f"], namespace["g"]))
    payload = buf.getvalue()
    code = (
        "import pickle, sys\n"
        "f, g = pickle.loads(sys.stdin.buffer.read())\n"
        "m = sys.modules[f.__globals__['__name__']]\n"
        "assert vars(m) is f.__globals__ is g.__globals__, 'one namespace, registered'\n"
        "assert m.__file__ == '/x/cfg.py' and m.K == 3\n"
        "import torch\n"
        "print(torch.compile(g, backend='eager')(torch.tensor(4.0)).item())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert float(done.stdout.decode().split()[-1]) == 7.0


def test_a_scripts_main_module_arrives_under_an_alias_beside_the_workers_own():
    namespace = {"__name__": "__main__"}
    exec("import torch\ndef f(x):\n    return torch.floor(x)", namespace)
    buf = io.BytesIO()
    UserPickler(buf).dump(namespace["f"])
    f = pickle.loads(buf.getvalue())
    name = f.__globals__["__name__"]
    assert name != "__main__" and vars(sys.modules[name]) is f.__globals__
    assert torch.compile(lambda x: f(x) + 0, backend="eager")(torch.tensor(2.5)).item() == 2.0  # f inlined


SPAWNING = """
import sys, torch
from autotune.run.cfg import load_config
cfg = load_config(sys.argv[1])
loader = torch.utils.data.DataLoader(cfg["dataset"], batch_size=64, num_workers=1, multiprocessing_context="spawn",
                                     collate_fn=cfg["collate_fn"])
print(sum(int(b["label"].sum()) for b in loader))
"""


def test_a_cfg_dataset_reaches_spawned_loader_workers_of_the_process_that_loaded_it(tmp_path):
    """The process that runs the cfg holds its classes in ``__autotune_cfg__``, which a spawned
    process cannot import: they go by value."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text(DATA_CFG)
    done = subprocess.run(
        [sys.executable, "-c", SPAWNING, str(cfg)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = int(sum(int(s["label"]) for s in load_config(cfg)["dataset"]))
    assert int(done.stdout.split()[-1]) == expected


# A module as a script or a notebook loads one by hand: never put in sys.modules.
BY_HAND = """
import importlib.util, sys
import torch
import autotune

spec = importlib.util.spec_from_file_location("net_by_hand", sys.argv[1])
cfg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cfg)
assert "net_by_hand" not in sys.modules
model = cfg.model()
config = {"compile_mode": "default", "batch_size": 64}
tuned = autotune.apply(model, config, device="cpu")
x = torch.stack([cfg.dataset[i][0] for i in range(64)])
with torch.no_grad():
    assert torch.allclose(tuned(x), model(x), atol=1e-5)
print(sys.modules["net_by_hand"] is cfg)
"""


def test_a_compiled_winner_of_a_model_from_a_module_loaded_by_hand_runs_in_apply(tmp_path):
    """``autotune.apply`` of a compiled configuration, in the user's own process, on a class of
    a module loaded with importlib and never registered: dynamo imports the module by the name
    in the class's globals, and failed with a raw "No module named 'net_by_hand'"."""
    cfg = tmp_path / "net.py"
    cfg.write_text(NET_CFG)
    done = subprocess.run(
        [sys.executable, "-c", BY_HAND, str(cfg)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"  # the user's own module object, not a copy


def test_the_module_of_a_class_run_by_runpy_is_importable_for_the_compiler(tmp_path):
    import importlib
    import runpy

    from autotune.knobs.compiler import importable_globals

    cfg = tmp_path / "net.py"
    cfg.write_text(NET_CFG)
    ns = runpy.run_path(str(cfg), run_name="__net_run_path__")  # runpy drops its module afterwards
    assert "__net_run_path__" not in sys.modules
    try:
        assert importable_globals(ns["model"]()) == ["__net_run_path__"]
        module = importlib.import_module("__net_run_path__")
        assert module.Net is ns["Net"] and module.SCALE == 0.5  # what the traced forward reads
        assert importable_globals(ns["model"]()) == []  # registered once
    finally:
        sys.modules.pop("__net_run_path__", None)


# Python's own recipe for importing a file by hand: the module is registered under a name that
# the import path does not lead to.
BY_RECIPE = """
import importlib.util, json, sys
import autotune

spec = importlib.util.spec_from_file_location("rows_by_recipe", sys.argv[1])
cfg = importlib.util.module_from_spec(spec)
sys.modules["rows_by_recipe"] = cfg
spec.loader.exec_module(cfg)
result = autotune.optimize(
    cfg.model, cfg.dataset, n_trials=2, fix={"num_workers": 2}, max_metric_drop=1.0, export=(), device="cpu",
    out_dir=sys.argv[2], collate_fn=cfg.collate_fn, metric=cfg.metric, **cfg.options,
)
print(json.dumps([t.user_attrs.get("status") for t in result.study.trials]), result.verdict)
"""


def test_classes_of_a_module_imported_by_pythons_recipe_reach_the_trial_workers(tmp_path):
    """``spec_from_file_location`` + ``sys.modules[name] = module``: the classes were pickled by
    reference, and every trial worker failed to start with "No module named 'rows_by_recipe'"."""
    cfg = tmp_path / "data" / "rows.py"
    cfg.parent.mkdir()
    cfg.write_text(DATA_CFG.replace("model = Head().eval()", "def model():\n    return Head().eval()"))
    done = subprocess.run(
        [sys.executable, "-c", BY_RECIPE, str(cfg), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    statuses, verdict = done.stdout.split("\n")[-2].rsplit(" ", 1)
    assert json.loads(statuses) == ["ok", "ok"] and verdict != "failed", done.stdout[-2000:]


def test_only_modules_no_other_process_could_import_travel_by_value(tmp_path):
    import importlib

    import cloudpickle

    from autotune.trial.usercode import hand_loaded_by_value

    source = tmp_path / "elsewhere.py"
    source.write_text("def f():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("mod_by_recipe", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mod_by_recipe"] = module
    spec.loader.exec_module(module)
    try:
        made = hand_loaded_by_value()
        assert "mod_by_recipe" in made and "autotune" not in made and "torch" not in made and "json" not in made
        assert cloudpickle.cloudpickle._is_registered_pickle_by_value(module)
    finally:
        sys.modules.pop("mod_by_recipe", None)
