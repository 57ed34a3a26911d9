"""cfg.py: the user's Python file that defines ``model`` and ``dataset``.

It is the user's own code and is executed as such, once, in this process. It may also define
``metric``, ``max_metric_drop``, ``space``, ``loss_fn`` (enables recovery fine-tuning after
pruning), ``train_dataset``, ``test_dataset`` (held-out samples scored after the search) and
``options`` (a dict of any other keyword of :func:`autotune.optimize`).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError, InputError

__all__ = ["load_config", "CFG_KEYS", "CFG_MODULE"]

# The module name a cfg.py runs as, in this process and in every worker of the run.
CFG_MODULE = "__autotune_cfg__"

CFG_KEYS = (
    "model",
    "dataset",
    "metric",
    "max_metric_drop",
    "space",
    "options",
    "loss_fn",
    "train_dataset",
    "test_dataset",
    "mode",
    "optimizer",
    "collate_fn",
)


def load_config(path: str | Path) -> dict[str, Any]:
    """Execute a cfg.py and return what it defines for autotune.

    Returns:
        A dict with ``model`` and ``dataset`` and whichever of ``metric``, ``max_metric_drop``,
        ``space`` and ``options`` the file defines.

    Raises:
        InputError: the file is missing, a run's directory or ``best_config.json``, unreadable, not valid Python, raises, or lacks
            ``model`` or ``dataset``.
    """
    path = Path(path)
    if path.suffix == ".json" or (path / "best_config.json").is_file():
        raise InputError(
            f"{str(path)!r} is a run's config, not a cfg.py: pass it as `config` to autotune.apply, dataloader or "
            "predict (a run's directory, its best_config.json or that file's dict all work); load_config runs a "
            "Python file that defines model and dataset."
        )
    if not path.exists():
        raise InputError(
            f"cfg file {str(path)!r} does not exist. Give the path of a Python file that defines model and dataset."
        )
    if not path.is_file():
        raise InputError(f"cfg file {str(path)!r} is not a file.")
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read cfg file {str(path)!r}: {exc}") from None
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise InputError(f"cfg file {path!s} has a syntax error at line {exc.lineno}: {exc.msg}.") from None
    # Its own directory is importable, as when the file is run as a script.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        namespace = _execute(code, path)
    except SystemExit as exc:
        raise InputError(f"cfg file {path!s} called exit({exc.code}) while loading.") from None
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
        where = f" (line {frames[-1].lineno})" if frames else ""
        raise InputError(f"cfg file {path!s} raised {type(exc).__name__}{where}: {exc}") from exc
    missing = [k for k in ("model", "dataset") if k not in namespace]
    if missing:
        raise InputError(
            f"cfg file {path!s} must define {' and '.join(missing)} (an object or a zero-argument function); "
            f"it defines: {', '.join(sorted(k for k in namespace if not k.startswith('_'))) or 'nothing'}."
        )
    cfg = {k: namespace[k] for k in CFG_KEYS if k in namespace}
    if "options" in cfg and not isinstance(cfg["options"], dict):
        raise ConfigError(
            f"`options` in {path!s} must be a dict of optimize() keywords, but is {type(cfg['options']).__name__}."
        )
    return cfg


def _execute(code: Any, path: Path) -> dict[str, Any]:
    """Run the file as the module ``__autotune_cfg__``, registered while it lives: the compiler
    looks a traced function's module up by name, and the run's other processes receive its
    classes and functions by value into a module of the same name (:mod:`autotune.trial.usercode`)."""
    from autotune.trial.usercode import by_value_in_children, register_user_module

    # Registered before it runs: a class's dataclass or typing machinery looks it up meanwhile.
    module = register_user_module(CFG_MODULE, str(path.resolve()))
    by_value_in_children()  # a DataLoader's spawned workers cannot import it by name: by value
    exec(code, vars(module))
    return vars(module)
