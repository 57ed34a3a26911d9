"""The package's public face: light import, explicit API, presets inside the package."""

import subprocess
import sys

import autotune
from tests.layout import find_cycle


def test_import_is_light():
    code = "import autotune, sys; print('torch' in sys.modules, 'optuna' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_public_names():
    assert set(autotune.__all__) >= {
        "optimize",
        "apply",
        "dataloader",
        "load_config",
        "Config",
        "Result",
        "AutotuneError",
    }
    for name in autotune.__all__:
        assert getattr(autotune, name) is not None


def test_errors_share_one_root():
    for cls in (autotune.ConfigError, autotune.InputError, autotune.TrialError, autotune.ExportError):
        assert issubclass(cls, autotune.AutotuneError)


def test_presets_are_found_from_any_directory(tmp_path):
    code = "from autotune.search.space import list_presets; print(sorted(list_presets()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert "'default'" in out and "'quick'" in out


# --- the layout (docs/architecture.md) ------------------------------------------------------------


def _import_graph() -> tuple[dict[str, set[str]], list[tuple[int, str]]]:
    """Every module of the package and the modules it imports (at the top and inside functions,
    as the AST has them), and the body length of every function."""
    import ast
    from pathlib import Path

    root = Path(autotune.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(("autotune", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        modules[name] = path
    graph, lengths = {}, []
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autotune"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
                lengths.append((node.end_lineno - body[0].lineno + 1, f"{name}.{node.name}"))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph, lengths


def test_a_dozen_modules_at_the_top_and_no_import_circle():
    graph, _ = _import_graph()
    top = [
        m
        for m in graph
        if m.count(".") == 1
        and m.split(".")[1]
        not in {"compress", "deploy", "doctor", "export", "knobs", "report", "run", "runtimes", "search", "trial"}
    ]
    assert len(top) <= 12, sorted(top)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_module_longer_than_450_lines():
    from pathlib import Path

    root = Path(autotune.__file__).parent
    sizes = {str(p.relative_to(root.parent)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    long = sorted(((n, p) for p, n in sizes.items() if n > 450), reverse=True)
    assert not long, long


def test_no_function_longer_than_70_lines():
    _, lengths = _import_graph()
    long = sorted(((n, f) for n, f in lengths if n > 70), reverse=True)
    assert not long, long


# The floors, top down: a module imports its own floor and those below it, not one above, not
# even inside a function. The public face (``autotune/__init__``) and the CLI sit on top; deploy
# reads a finished run, beside it.
FLOORS = (
    ("autotune", "__main__", "cli"),
    ("run", "deploy"),
    ("search", "doctor"),
    ("trial",),
    ("report", "config"),
    ("knobs",),
    ("runtimes",),
    ("compress",),
    ("export",),
    ("batching",),
    ("shapes",),
    ("data", "samples", "env", "errors", "record", "_pristine", "_lazy"),
)
# The imports that still run up a floor, each with a comment at its line that says why: the
# guard's judgement (trial/fidelity.py, a leaf) shared by export/parity.py and compress/fallback.py.
N_UPWARD = 2


def _floor(module: str) -> int:
    """How far down ``module``'s floor is (0: the top)."""
    name = module.split(".")[1] if "." in module else module
    found = [i for i, names in enumerate(FLOORS) if name in names]
    assert found, f"{module} is on no floor: add it to FLOORS"
    return found[0]


def test_imports_run_down_the_floors():
    graph, _ = _import_graph()
    upward = sorted((m, d) for m, deps in graph.items() for d in deps if _floor(d) < _floor(m))
    assert len(upward) <= N_UPWARD, upward


# --- the distribution (README "Install") ------------------------------------------------------------


def _project() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the backport autotune requires there
        import tomli as tomllib
    from pathlib import Path

    return tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]


def test_the_distribution_has_a_name_of_its_own_and_installs_the_autotune_command():
    project = _project()
    # "autotune" on PyPI is an unrelated project; the module and the command keep the name.
    assert project["name"] == "torch-autotune"
    assert project["scripts"] == {"autotune": "autotune.cli:main"}


def test_every_package_of_the_source_is_in_the_distribution():
    """The distribution lists its packages: autotune.runtimes was added to the source and not to
    the list, and an installed (not editable) autotune could not import it."""
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "autotune").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


def test_the_default_install_is_a_cpu_one_and_the_gpu_extra_adds_the_gpu_onnxruntime():
    from packaging.requirements import Requirement

    project = _project()
    core = {Requirement(r).name for r in project["dependencies"]}
    assert "onnxruntime" in core and "onnxruntime-gpu" not in core
    extras = {name: {Requirement(r).name for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    assert {"onnxruntime-gpu", "nvidia-ml-py"} <= extras["gpu"]
    # What only the tests use stays in `dev`, out of a user's install.
    assert not core & {"pytest", "pytest-timeout", "playwright", "ruff", "scikit-learn", "transformers"}
    assert {"pytest", "playwright", "ruff"} <= extras["dev"]
