"""The :class:`Runtime` contract and the registry of runtimes, keyed by name.

A runtime runs the tuned model in place of PyTorch: it builds a candidate inside its trial
(an exported file and the module that runs it), exports the winner's file at the finish with
the runner its parity check calls, and opens a saved file for :func:`autotune.load`. Each lives
in one module of :mod:`autotune.runtimes`, registered by :func:`register`; nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from autotune.errors import ConfigError

__all__ = [
    "REGISTRY",
    "Runtime",
    "by_format",
    "doctor_row",
    "formats",
    "get_runtime",
    "names",
    "of_format",
    "precision_knob",
    "register",
    "requestable_formats",
    "restoring",
]


class Runtime:
    """Base class of every runtime.

    Subclasses set ``name`` (the ``runtime`` knob's value), ``format`` (the artifact format its
    file is, a key of ``best_config.json``'s ``artifacts``), ``file_name`` (that file in the
    output folder), ``order`` (its place among the knob's choices) and ``help``, and implement
    :meth:`build`. They override :meth:`problem` where the runtime is not offered everywhere,
    :meth:`export` and :meth:`open_file` where the winner's file is exported and loaded,
    :meth:`open` where a saved file is served by :func:`autotune.load` (and :meth:`open_light`
    where it is served without torch), and :meth:`doctor_facts` and :meth:`doctor_checks` where
    ``autotune doctor`` has something to check. Heavy imports (the runtime's own package, torch)
    stay inside the methods: ``import autotune`` imports none.
    """

    name: ClassVar[str]
    format: ClassVar[str]
    file_name: ClassVar[str]
    # Where the runtime sits among the ``runtime`` knob's choices (after "torch", lower first).
    order: ClassVar[int] = 1000
    # Where its artifact sits among the formats when a run is loaded without one named (lower
    # first: an ONNX graph runs without Python's model code).
    load_rank: ClassVar[int] = 1000
    help: ClassVar[str] = ""
    # How a sentence names its artifact ("an OpenVINO artifact"); its name where unset.
    title: ClassVar[str] = ""
    # The distributions that install its Python package, any one of which will do (ONNX Runtime's
    # two wheels): the doctor's requirement check and `autotune verify`'s version diff read them.
    packages: ClassVar[tuple[str, ...]] = ()
    # The knob that sets the precision of its own graph (``ort_precision``): where there is one,
    # torch's precision, quantization and layout knobs do not apply to the candidate.
    precision_knob: ClassVar[str | None] = None
    # Its module does work for each new input shape on first sight (a trace, a plugin's kernels).
    compiles_per_shape: ClassVar[bool] = False
    # A winner of this runtime ships its measured file whatever formats the run exports.
    always_ships: ClassVar[bool] = False
    # ``optimize(export=...)`` may ask for its format: the winner's model exported to it, whatever
    # runtime the winner ran.
    export_on_request: ClassVar[bool] = True
    # Its file runs with numpy alone: :func:`autotune.load` serves it without importing torch
    # (:meth:`open_light`).
    runs_without_torch: ClassVar[bool] = False
    # Its file returns the model's outputs flat, by name (a graph), where the model may return a dict.
    flat_outputs: ClassVar[bool] = False
    # Its file may hold the batch size it was made with (a trace): a load feeds it full batches.
    fixed_batch: ClassVar[bool] = False
    # Where it runs a winner of another runtime on the CPU: why it cannot run the graph an export
    # under bfloat16 autocast writes (the file is then exported in float32, without autocast, and
    # says so); ``None`` where it can.
    no_cpu_autocast: ClassVar[str | None] = None

    def problem(self, ctx: Any) -> str | None:
        """Why the runtime is not offered on ``ctx`` (a :class:`~autotune.knobs.base.SpaceContext`),
        or ``None`` where it is."""
        return None

    def build(self, state: Any, extras: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
        """The candidate of ``state``'s configuration, made from ``state.model`` in ``folder``:
        the module that runs it and what to record of it. Sets ``state.artifact`` to the file it
        runs (``format``, ``path``, ``input_names`` and the settings a load needs).

        Raises:
            TrialError: ``unsupported`` when the runtime cannot run this candidate; any other
                exception is turned into one by the ``runtime`` knob.
        """
        raise NotImplementedError

    def export(
        self, model: Any, example: Any, path: Path, *, device: str, fallback: Any, source: Any, spatial: bool
    ) -> tuple[dict[str, Any], Callable[..., Any]]:
        """Write ``model``'s file at ``path`` for the run's artifacts, and a function that runs
        the saved file as ``model`` is called (outputs in ``model``'s structure), for its parity
        check. ``device`` is the model's (the check runs there); ``fallback``, ``source`` and
        ``spatial`` are :func:`autotune.runtimes.artifacts.export_artifacts`' ``fallback``,
        ``onnx_source`` and ``spatial``, for the runtime that reads them.

        Returns:
            ``(info, run)``: the exporter's details (``path``, ``input_names``...) and the runner.
        """
        raise NotImplementedError(f"the {self.name} runtime exports no artifact")

    def nearest_source(self, state: Any, float_form: Any) -> tuple[Any, str] | None:
        """Where exporting a winner of another runtime (``state``, its build) to this format
        failed: the ``source`` :meth:`export` makes the nearest form from instead, and what that
        form is; ``None`` where there is no nearer form. ``float_form``: the winner's float model
        before its int8 (pruned), in its wrappers without autocast; ``None`` where it has none."""
        return None

    def open_file(self, path: Path, artifact: dict[str, Any]) -> Any:
        """The module that runs the file at ``path`` with the settings ``artifact`` recorded when
        it was measured (:attr:`~autotune.knobs.state.BuildState.artifact`)."""
        raise NotImplementedError(f"the {self.name} runtime opens no file")

    def open(self, path: Path, record: dict[str, Any], device: str) -> Any:
        """The module that serves the saved artifact at ``path`` on ``device``, for
        :func:`autotune.load`; ``record`` is its entry in ``best_config.json``."""
        return self.open_file(path, record)

    def open_light(self, path: Path, record: dict[str, Any]) -> Any:
        """The module that serves the saved artifact at ``path`` on the CPU with numpy alone,
        importing no torch, for :func:`autotune.load` where torch is not wanted or not installed:
        ``module.run(arrays)`` takes the inputs as numpy arrays in ``record``'s ``input_names``
        order and returns the outputs, flat, as numpy arrays. For a runtime that sets
        ``runs_without_torch``; ``record`` is its entry in ``best_config.json``."""
        raise NotImplementedError(f"the {self.name} runtime needs torch to run its file")

    def load_settings(self, config: Any, device: str) -> dict[str, Any]:
        """What the record of the run's artifact in this format holds besides its file, for its
        load: the settings of the winner's ``config`` it runs with on the run's ``device``
        (``config`` reads each knob's value as an attribute, ``config.num_threads``)."""
        return {}

    def files(self, path: Path) -> list[Path]:
        """The artifact's files besides ``path`` (a weights file), removed with it."""
        return []

    def ship_files(self, source: Path, path: Path, record: dict[str, Any]) -> None:
        """Copy the files besides the artifact at ``source`` (see :meth:`files`) beside its copy
        at ``path``, and add them to its ``record`` (their names, digests and bytes)."""

    def profiling(self, model: Any, scratch: Path) -> list[Any]:
        """This runtime's sessions inside ``model``, each set to record its own node times into
        files under ``scratch`` from its next run: what the PyTorch profiler cannot see into (a
        runtime whose work shows as PyTorch operators has none: ``[]``)."""
        return []

    def profiled(self, sessions: list[Any], n_active: int) -> tuple[list[dict[str, Any]], list[str]]:
        """The node times ``sessions`` (from :meth:`profiling`) recorded over their last
        ``n_active`` runs, one row per node type as :func:`autotune.trial.opfamily.summarize`
        reads them, and the trace files they wrote (Chrome's trace format)."""
        return [], []

    def unprofile(self, sessions: list[Any]) -> None:
        """Set ``sessions`` back to running unrecorded."""

    def doctor_facts(self, on_cuda: bool) -> dict[str, Any] | None:
        """What ``autotune doctor`` records of the runtime on this machine, as a JSON-safe dict
        (its version, why it cannot run here, what it offers), or ``None`` where it has nothing
        to check. ``on_cuda``: torch has a CUDA device here. A failure to collect may raise: the
        doctor records it as the section's ``{"error": ...}``."""
        return None

    def doctor_checks(self, facts: dict[str, Any]) -> list[dict[str, Any]]:
        """The doctor's rows of the runtime's section, a pure function of the facts the doctor
        gathered (perhaps on another machine): the runtime's own under ``facts[self.name]`` (see
        :meth:`doctor_facts`) and the host's (``packages``, ``cpu``, ``gpus``). Each row is
        ``{"name", "status", "detail"}``, with ``"fix"`` where there is something to do;
        ``status`` is ``"ok"``, ``"info"``, ``"warn"`` or ``"fail"``."""
        return []


REGISTRY: dict[str, Runtime] = {}


def register(cls: type[Runtime]) -> type[Runtime]:
    """Class decorator: add an instance of ``cls`` to :data:`REGISTRY` under ``cls.name``."""
    if cls.name == "torch" or cls.name in REGISTRY:
        raise ConfigError(f"A runtime named {cls.name!r} is registered already.")
    REGISTRY[cls.name] = cls()
    return cls


def names() -> tuple[str, ...]:
    """The registered runtimes' names, in their ``order``."""
    return tuple(r.name for r in sorted(REGISTRY.values(), key=lambda r: (r.order, r.name)))


def get_runtime(name: str) -> Runtime:
    """The runtime registered as ``name``.

    Raises:
        ConfigError: no runtime has that name (the message lists those that do).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"No runtime named {name!r}. Known: torch, {', '.join(names())}.") from None


def precision_knob(runtime: str) -> str | None:
    """The knob that sets the precision of ``runtime``'s own graph (``ort_precision``), or
    ``None`` where torch's precision knobs apply (``torch``, TorchScript)."""
    found = REGISTRY.get(runtime)
    return None if found is None else found.precision_knob


def formats() -> tuple[str, ...]:
    """The artifact formats the runtimes write, in the order a load prefers them."""
    ranked = sorted(REGISTRY.values(), key=lambda r: (r.load_rank, r.order, r.name))
    return tuple(dict.fromkeys(r.format for r in ranked))


def requestable_formats() -> tuple[str, ...]:
    """The artifact formats ``optimize(export=...)`` may ask for, in the order of :func:`formats`."""
    return tuple(f for f in formats() if by_format(f).export_on_request)


def by_format(fmt: str) -> Runtime:
    """The runtime whose artifacts are in format ``fmt``.

    Raises:
        ConfigError: no runtime writes ``fmt`` (the message lists the formats).
    """
    runtime = of_format(fmt)
    if runtime is None:
        raise ConfigError(f"No artifact format named {fmt!r}. Known: {', '.join(formats())}.")
    return runtime


def of_format(fmt: str) -> Runtime | None:
    """The runtime whose artifacts are in format ``fmt``, or ``None`` (``"torch"``: the model itself)."""
    return next((r for r in REGISTRY.values() if r.format == fmt), None)


def doctor_row(name: str, status: str, detail: str, fix: str | None = None) -> dict[str, Any]:
    """One row of :meth:`Runtime.doctor_checks`: what was checked, ``"ok"``, ``"info"``,
    ``"warn"`` or ``"fail"``, what was found and what to do about it."""
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def restoring(model: Any, example: Any, runner: Callable[..., Any]) -> Callable[..., Any]:
    """``runner`` (a module that runs an exported graph, its outputs flat) with its outputs put
    back in the structure ``model``'s have on ``example``, as a metric expects them."""
    import torch

    from autotune.export.parity import restore_like
    from autotune.samples import model_inputs

    args, kwargs = model_inputs(example)
    with torch.no_grad():
        template = model(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        return restore_like(template, runner(*args, **kwargs))

    return run
