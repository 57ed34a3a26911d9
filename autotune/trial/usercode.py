"""User code that travels: classes and functions defined in a cfg.py, a script's ``__main__`` or
a module loaded by hand, sent by value to the processes a run starts.

cloudpickle sends such functions with a fresh dict for their globals, still named after their
module (``__autotune_cfg__``, ``__main__``, ``jpeg_cfg``). Two things then break in the
receiving process:

- ``torch.compile`` imports a function's module by the ``__name__`` in its globals to guard
  them: ``No module named '__autotune_cfg__'``, or the worker's own ``__main__`` without the
  user's names.
- A DataLoader started there with ``forkserver`` or ``spawn`` pickles the user's dataset class
  by reference: "it's not the same object as jpeg_cfg.PhotoFolder".

:class:`UserPickler` sends a by-value function's globals as the namespace of a real module that
the receiving process registers in ``sys.modules`` (under its own name where that name is free
there, under an alias otherwise), so the compiler finds the same globals it traces.
:func:`by_value_in_children` makes the DataLoader's worker processes receive what is not
importable by reference by value too.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import types
from typing import Any

import cloudpickle

__all__ = [
    "UserPickler",
    "by_value_in_children",
    "dumps",
    "hand_loaded_by_value",
    "pickle_module",
    "register_user_module",
    "user_module",
]

# Marks the modules this file made, so a second payload's functions share the first's namespace.
_MARK = "__autotune_user_module__"


def user_module(name: str, file: str | None = None) -> types.ModuleType:
    """The module a by-value namespace called ``name`` lives in here: made and registered once,
    under ``name`` where no other module holds it, else under an alias (``__main__`` is the
    worker's own)."""
    held = sys.modules.get(name)
    if held is not None and getattr(held, _MARK, False):
        return held
    if held is not None:
        alias = "__autotune_user_" + re.sub(r"\W", "_", name).strip("_") + "__"
        aliased = sys.modules.get(alias)
        if aliased is not None and getattr(aliased, _MARK, False):
            return aliased
        name = alias
    return register_user_module(name, file)


def register_user_module(name: str, file: str | None = None) -> types.ModuleType:
    """A new module ``name`` for user code, registered in ``sys.modules`` (replacing any of that
    name) and marked as one no other process can import: its classes and functions go to trial
    workers and to spawned loader workers by value."""
    module = types.ModuleType(name)
    setattr(module, _MARK, True)
    if file:
        module.__file__ = file
    sys.modules[name] = module
    cloudpickle.register_pickle_by_value(module)  # and on from here by value, never by a name no other process has
    return module


def _namespace(name: str, file: str | None) -> dict[str, Any]:
    """Unpickles a by-value function's globals: its module's own dict."""
    return vars(user_module(name, file))


class _Namespace(dict):
    """A function's globals on their way out: they arrive as a module's namespace."""

    def __reduce__(self) -> Any:
        return _namespace, (self.get("__name__", "__autotune_user__"), self.get("__file__"))


class UserPickler(cloudpickle.Pickler):
    """cloudpickle, with a by-value function's globals arriving as a registered module's dict.

    Example:
        >>> import io, pickle
        >>> ns = {"__name__": "__example_cfg__"}
        >>> exec("import math\\ndef area(r):\\n    return math.pi * r * r", ns)
        >>> buf = io.BytesIO(); UserPickler(buf).dump(ns["area"])
        >>> f = pickle.loads(buf.getvalue())
        >>> f(1.0) == ns["area"](1.0), sys.modules[f.__globals__["__name__"]].__dict__ is f.__globals__
        (True, True)
    """

    def _function_getnewargs(self, func: Any) -> Any:
        key = id(func.__globals__)
        if key not in self.globals_ref:
            base = _Namespace()
            for k in ("__package__", "__name__", "__path__", "__file__"):
                if k in func.__globals__:
                    base[k] = func.__globals__[k]
            self.globals_ref[key] = base
        return super()._function_getnewargs(func)


# What torch.save takes as its pickle module: UserPickler for the objects, pickle for the rest.
pickle_module = types.SimpleNamespace(
    __name__="autotune.trial.usercode", Pickler=UserPickler, dump=cloudpickle.dump, dumps=cloudpickle.dumps
)


def _arrived_by_value(obj: Any) -> bool:
    """Whether ``obj`` (a class or function) is one that no other process can import as itself:
    it arrived by value, or its module's name now holds another object."""
    if isinstance(obj, type) and obj in getattr(cloudpickle.cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_CLASS", ()):
        return True
    if isinstance(obj, types.FunctionType):
        home = sys.modules.get(obj.__globals__.get("__name__") or "")
        if home is not None and getattr(home, _MARK, False):
            return True
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None:
        return False  # not imported here yet: pickle imports it
    if getattr(module, _MARK, False):
        return True
    found: Any = module
    for part in (getattr(obj, "__qualname__", None) or "").split("."):
        found = getattr(found, part, None)
    return found is not None and found is not obj


_checked: dict[int, tuple[Any, bool]] = {}


def _by_value(obj: Any) -> bool:
    hit = _checked.get(id(obj))
    if hit is None or hit[0] is not obj:
        hit = _checked[id(obj)] = (obj, _arrived_by_value(obj))
    return hit[1]


def _reducer_override(self: Any, obj: Any) -> Any:
    # Classes and functions that no other process can import, and instances of such classes,
    # go by value; the rest as pickle sends them.
    if _by_value(obj if isinstance(obj, (type, types.FunctionType)) else type(obj)):
        return cloudpickle.loads, (dumps(obj),)
    return NotImplemented


def dumps(obj: Any) -> bytes:
    """``obj`` pickled by :class:`UserPickler`."""
    import io

    buf = io.BytesIO()
    UserPickler(buf).dump(obj)
    return buf.getvalue()


def by_value_in_children() -> None:
    """Processes started from this one by ``spawn`` or ``forkserver`` (a DataLoader's workers)
    receive the user's by-value classes, functions and objects by value: a trial worker holds
    them under names that no other process can import."""
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.reducer_override = _reducer_override  # type: ignore[attr-defined]


def _found_elsewhere(module: types.ModuleType) -> bool:
    """Whether a process with this one's import path (a trial worker's) imports ``module`` by its
    name as the same file: the import system's finders, asked past ``sys.modules``, find it there."""
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None)
    name = module.__name__
    parent = name.rpartition(".")[0]
    path = getattr(sys.modules.get(parent), "__path__", None) if parent else None
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            found = None if find is None else find(name, path)
        except Exception:  # a finder that cannot answer for this name: the next one may
            continue
        if found is not None:
            return os.path.realpath(str(found.origin)) == os.path.realpath(str(origin))
    return False


_INSTALLED = tuple(
    {os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, *sysconfig.get_paths().values())}
)
# The module objects looked at, by name: each is looked at once, unless another takes its name.
_looked_at: dict[str, types.ModuleType] = {}


def hand_loaded_by_value() -> list[str]:
    """Make every module that another process cannot import as itself travel by value: one
    loaded from a file under a name the import path does not lead to, as Python's own recipe for
    importing a file by hand does (``importlib.util.spec_from_file_location``, then
    ``sys.modules[name] = module``). Pickled by reference, its classes failed every trial worker's
    start with ``No module named 'name'``. Installed and standard modules are not looked at.

    Returns:
        The names of the modules made to travel by value.
    """
    made = []
    for name, module in list(sys.modules.items()):
        if _looked_at.get(name) is module:
            continue
        _looked_at[name] = module
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if name == "__main__" or not isinstance(module, types.ModuleType) or getattr(module, _MARK, False):
            continue
        if not getattr(spec, "has_location", False) or not isinstance(origin, str):
            continue  # built-in, frozen, a namespace package: the import system's own
        if os.path.realpath(origin).startswith(_INSTALLED):
            continue
        if not _found_elsewhere(module):
            cloudpickle.register_pickle_by_value(module)
            made.append(name)
    return made
