"""Many workers on one study: one per listed device of this machine, each driving its own worker
process, all sharing the study through its storage (:mod:`autotune.search.study` says how they
coordinate). The result files of every hardware group of a study measured on several kinds of
hardware are written at the finish (:func:`autotune.run.output.write_hardware_groups`).

Workers on other machines are other ``autotune run --join`` processes; nothing here talks to
them, the storage does.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import signal
import socket
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = ["check_devices", "close_runners", "run_workers", "start_runners", "worker_ids"]


def _normalize(item: Any) -> str:
    if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
        return f"cuda:{item}"
    if isinstance(item, str):
        name = item.strip().lower()
        if name.isdigit():
            return f"cuda:{int(name)}"
        if name == "cpu" or (name.startswith("cuda:") and name[5:].isdigit()):
            return name
    raise ConfigError(f"`devices` entries must be GPU indices (0, 1, ...), 'cuda:N' or 'cpu', but got {item!r}.")


def check_devices(device: str, devices: Sequence[Any] | str | None, isolation: str) -> tuple[str, list[str] | None]:
    """Check ``devices`` and return ``(device of the first worker, one device per worker)``.

    ``devices=None`` keeps the single worker on ``device``. ``"cpu"`` may repeat (parallel CPU
    workers, for smoke tests); a GPU may not.

    Raises:
        ConfigError: an entry is not a device, the list mixes CPU and GPU or kinds of GPU,
            names a GPU twice, contradicts ``device``, or asks for several in-process workers.
    """
    if devices is None:
        return device, None
    if isinstance(devices, (int, str)) and not isinstance(devices, bool):
        items = str(devices).split(",")
    elif isinstance(devices, (list, tuple)):
        items = list(devices)
    else:
        raise ConfigError(f"`devices` must be a list such as [0, 1] or a string such as '0,1', but got {devices!r}.")
    normalized = [_normalize(d) for d in items if not (isinstance(d, str) and not d.strip())]
    if not normalized:
        raise ConfigError("`devices` must list at least one device, e.g. [0, 1] (CLI: --devices 0,1) or 'cpu,cpu'.")
    kind = normalized[0].split(":")[0]
    if any(d.split(":")[0] != kind for d in normalized):
        raise ConfigError(
            f"`devices` mixes CPU and GPUs ({', '.join(normalized)}); their timings must not meet. Run one "
            "autotune per kind of device, each with join=True (CLI: --join), on the same storage and study."
        )
    if kind == "cuda" and len(set(normalized)) != len(normalized):
        raise ConfigError(f"`devices` names a GPU twice ({', '.join(normalized)}); give each GPU once.")
    if device not in ("auto", normalized[0]) and device.split(":")[0] != kind:
        raise ConfigError(f"`device` is {device!r} but `devices` lists {', '.join(normalized)}; give only `devices`.")
    if len(normalized) > 1 and isolation == "inprocess":
        raise ConfigError(
            "Several `devices` need one worker process each; isolation='inprocess' runs one. "
            "Use isolation='subprocess' (the default)."
        )
    if kind == "cuda" and len(normalized) > 1:
        from autotune.env import Env

        keys = {d: Env.detect(d).hardware_key() for d in normalized}
        if len(set(keys.values())) > 1:
            listing = "; ".join(f"{d}: {k}" for d, k in keys.items())
            raise ConfigError(
                f"`devices` are different hardware ({listing}); their timings must not meet in one group. "
                "Run one autotune per kind of GPU, each with join=True (CLI: --join)."
            )
    if kind == "cpu" and len(normalized) > 1:
        warnings.warn(
            f"{len(normalized)} CPU workers share this machine's cores, so each one's timings are distorted by "
            "the others: use parallel CPU workers to smoke-test a shared study, not to measure.",
            UserWarning,
            stacklevel=3,
        )
    return normalized[0], normalized


def worker_ids(devices: Sequence[str] | None) -> list[str]:
    """``host:pid`` for the single worker, ``host:pid:gpuN`` / ``host:pid:cpuN`` for each device's."""
    base = f"{socket.gethostname()}:{os.getpid()}"
    if devices is None:
        return [base]
    n_cpu = 0
    ids = []
    for device in devices:
        if device == "cpu":
            ids.append(f"{base}:cpu{n_cpu}")
            n_cpu += 1
        else:
            ids.append(f"{base}:gpu{device.split(':')[1]}")
    return ids


def _pin(device: str) -> dict[str, str]:
    """The worker environment that shows it only its GPU (which then is its ``cuda:0``)."""
    if device == "cpu":
        return {}
    index = int(device.split(":")[1])
    # Indices count within what this process sees: a scheduler may already have narrowed it.
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return {"CUDA_VISIBLE_DEVICES": visible[index] if index < len(visible) else str(index)}


# Where runs on this machine keep what their workers compiled, converted and quantized, shared
# across runs (unset: the user's cache folder, ~/.cache/autotune; "run": a cache per run, in
# OUT/compile-cache; else a folder).
CACHE_DIR_ENV = "AUTOTUNE_CACHE_DIR"


def machine_cache_dir(out: Path) -> Path:
    """The compile cache a run's workers share, and with them every later run on the machine.

    Every entry is keyed on what it was made from: inductor's and Triton's on the graph, the
    torch version and its settings; the OpenVINO conversions, NNCF's int8 models and the ONNX
    exports on the torch module (its structure, weights and buffers) and the cache's format
    (:mod:`autotune.export.run_cache`); and the folder is one per torch, OpenVINO and NNCF
    version. So a second run of the same model reads what the first made: on 2 cores a first run
    of real MiniLM paid 52-57 s to compile and 17-22 s for NNCF's calibration that a warm one did
    not. ``AUTOTUNE_CACHE_DIR=run`` keeps a cache per run (``OUT/compile-cache``), as does a
    cache folder that cannot be made.
    """
    import importlib.metadata

    setting = os.environ.get(CACHE_DIR_ENV, "").strip()
    if setting == "run":
        return out / "compile-cache"
    root = Path(setting) if setting else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autotune"
    versions = []
    for name in ("torch", "openvino", "nncf"):
        try:
            versions.append(f"{name}-{importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    folder = root / "_".join(versions).replace("+", "-")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return out / "compile-cache"
    return folder


def compile_cache_env(cache_dir: Path | None) -> dict[str, str]:
    """The worker environment that shares inductor's FX-graph and autotuning caches (and
    Triton's kernels) in ``cache_dir``: a graph compiled by one trial, or by the worker before a
    restart, is read back by the next trial, the confirmation's fresh workers and a resumed run."""
    if cache_dir is None:
        return {}
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        "TRITON_CACHE_DIR": str(cache_dir / "triton"),
        # OpenVINO's int8 models as NNCF made them (autotune.export.ov_cache).
        "AUTOTUNE_OPENVINO_CACHE": str(cache_dir / "openvino"),
        # ONNX graphs as the exporter wrote them (autotune.export.onnx_cache).
        "AUTOTUNE_ONNX_CACHE": str(cache_dir / "onnx"),
    }


def start_runners(
    spec: Any,
    devices: Sequence[str] | None,
    isolation: str,
    trial_timeout: float,
    log_dir: Path,
    cache_dir: Path | None = None,
) -> list[Any]:
    """One runner per worker: the single classic one, or one pinned worker process per device,
    started in parallel (each imports torch and builds the baseline's reference outputs). Worker
    processes share the compile cache in ``cache_dir`` (see :func:`compile_cache_env`)."""
    from autotune.trial.inprocess import InProcessRunner
    from autotune.trial.runner import SubprocessRunner, pickle_spec

    shared = compile_cache_env(cache_dir)
    if isolation == "inprocess":
        return [InProcessRunner(spec, shared)]
    if devices is None:
        cpu = str(spec.device).startswith("cpu")  # a fork server never touches CUDA, but is checked on CPUs only
        return [SubprocessRunner(pickle_spec(spec), trial_timeout, log_dir / "worker.log", shared, fork=cpu)]
    payloads = {d: pickle_spec(spec if d == "cpu" else dataclasses.replace(spec, device="cuda:0")) for d in devices}
    runners: list[Any] = [None] * len(devices)
    errors: list[BaseException] = []

    def start(i: int, device: str) -> None:
        try:
            env = {**shared, **_pin(device)}
            runners[i] = SubprocessRunner(payloads[device], trial_timeout, log_dir / f"worker-{i}.log", env)
        except BaseException as exc:  # reported below, in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i, d), daemon=True) for i, d in enumerate(devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        close_runners([r for r in runners if r is not None])
        raise errors[0]
    return runners


def close_runners(runners: Sequence[Any]) -> None:
    """Stop every runner's worker."""
    for runner in runners:
        runner.close()


def _worker_study(study: Any, seed: int, sampler: Any, worker: str) -> Any:
    """A study object of its own for one worker thread: its own sampler, seeded apart."""
    import optuna

    from autotune.search.storage import storage_of
    from autotune.search.study import make_sampler

    if sampler is None:
        sampler = make_sampler(seed ^ zlib.crc32(worker.encode()), parallel=True)
    else:
        sampler = copy.deepcopy(sampler)
        sampler.reseed_rng()
    return optuna.load_study(study_name=study.study_name, storage=storage_of(study), sampler=sampler)


def run_workers(
    study: Any,
    runners: Sequence[Any],
    space: Any,
    *,
    ids: Sequence[str],
    seed: int,
    sampler: Any,
    extra_attrs: dict[str, Any],
    on_trial: Callable[[dict[str, Any], int], None] | None = None,
    **options: Any,
) -> str:
    """Run :func:`autotune.search.study.run_trials` for every runner, one thread each, on one study.

    A single runner runs in this thread, as it always did. With several, Ctrl-C (or an error in
    any worker, such as a failed baseline) stops them all: the trials in flight are killed and
    marked ``interrupted``, and the first error is raised here.

    Args:
        ids: Worker ids, stamped on each trial as ``worker``.
        seed: Seeds each thread's default sampler (mixed with its worker id).
        sampler: A user's sampler, copied and reseeded per thread; ``None`` for the default.
        options: The other keyword arguments of :func:`~autotune.search.study.run_trials`.

    Returns:
        ``"n_trials"`` if any worker saw the trial count reached, else ``"timeout"`` or ``"exhausted"``.
    """
    stop = threading.Event()
    with _ctrl_c_sets(stop):
        return _run_workers(study, runners, space, stop, ids, seed, sampler, extra_attrs, on_trial, options)


@contextlib.contextmanager
def _ctrl_c_sets(stop: threading.Event) -> Iterator[None]:
    """Make Ctrl-C also set ``stop`` while the workers run.

    A KeyboardInterrupt that lands in a finalizer (SQLAlchemy cleans up its objects in weakref
    callbacks) is printed and swallowed by Python; the event survives it, and the loops check
    it between trials. A handler installed by someone else (a notebook, an IDE) is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_workers(
    study: Any,
    runners: Sequence[Any],
    space: Any,
    stop: threading.Event,
    ids: Sequence[str],
    seed: int,
    sampler: Any,
    extra_attrs: dict[str, Any],
    on_trial: Callable[[dict[str, Any], int], None] | None,
    options: dict[str, Any],
) -> str:
    from autotune.search.study import run_trials

    if len(runners) == 1:
        attrs = {**extra_attrs, "worker": ids[0]}
        return run_trials(study, runners[0], space, extra_attrs=attrs, on_trial=on_trial, stop=stop, **options)
    lock = threading.Lock()

    def report(record: dict[str, Any], n_done: int) -> None:
        with lock:  # progress printing and trials.csv are not thread-safe
            on_trial(record, n_done)

    outcomes: list[Any] = [None] * len(runners)

    def work(i: int) -> None:
        try:
            own = _worker_study(study, seed, sampler, ids[i])
            attrs = {**extra_attrs, "worker": ids[i]}
            callback = report if on_trial is not None else None
            outcomes[i] = run_trials(own, runners[i], space, extra_attrs=attrs, on_trial=callback, stop=stop, **options)
        except BaseException as exc:  # raised in the calling thread below
            outcomes[i] = exc
            if not stop.is_set():
                stop.set()
                for runner in runners:
                    runner.interrupt()

    threads = [
        threading.Thread(target=work, args=(i,), name=f"autotune-{ids[i]}", daemon=True) for i in range(len(runners))
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # wakes up for Ctrl-C
    except KeyboardInterrupt:
        stop.set()
        for runner in runners:
            runner.interrupt()
        for thread in threads:
            thread.join()
        raise
    errors = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, KeyboardInterrupt)]
    if errors:
        raise errors[0]
    if any(isinstance(o, KeyboardInterrupt) for o in outcomes):
        raise KeyboardInterrupt
    for reason in ("n_trials", "timeout", "converged"):
        if reason in outcomes:
            return reason
    return "exhausted"
