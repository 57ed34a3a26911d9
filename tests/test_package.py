"""The package's public face: light import, explicit API, presets inside the package."""

import subprocess
import sys

import autotune


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
