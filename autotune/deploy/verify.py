"""Re-check a tuning run's exported artifacts on this machine: :func:`verify`.

An out dir travels: it is copied to a server, unpacked in a container, run under another
ONNX Runtime. ``verify`` answers whether its artifacts are still the files that were checked,
whether they still give the tuned model's outputs here, how fast they run here, and what
differs between this machine and the one that ran the search.

Example:
    >>> report = verify("autotune-out")  # doctest: +SKIP
    >>> report["artifacts"]["onnx"]["status"]  # doctest: +SKIP
    'ok'
"""

from __future__ import annotations

import inspect
import json
import math
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from autotune.deploy.light import _modified
from autotune.deploy.load import _read_artifacts, _read_parity, run_device
from autotune.deploy.serve import load
from autotune.errors import ConfigError
from autotune.export import file_digest
from autotune.export.parity import _errors, _finite, check_parity, describe_error, flat_inputs
from autotune.runtimes.base import REGISTRY, Runtime, names
from autotune.samples import map_tensors
from autotune.trial.guard import fidelity

__all__ = ["ENV_KEYS", "THROUGHPUT_NOTES", "env_diff", "verify"]

# The export's own tolerance, read from check_parity so the two cannot drift apart.
_RTOL_L2: float = inspect.signature(check_parity).parameters["rtol_l2"].default
_N_WARMUP = 3
_N_REPEATS = 3

ENV_KEYS = ("device", "gpu_name", "gpu_capability", "cpu_capability", "cpu_threads", "machine")

THROUGHPUT_NOTES = {
    "samples_per_s": "artifact only: pre-collated batches already on the device, no data loading",
    "recorded_samples_per_s": "end to end (DataLoader, host-to-device copy and model) on the search's machine",
}


def _read_run(out_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(artifacts, the whole best_config.json) of a run directory."""
    artifacts, _ = _read_artifacts(out_dir)  # raises the ConfigErrors for a missing dir or file
    return artifacts, json.loads((out_dir / "best_config.json").read_text())


def _named_inputs(batch: Any) -> dict[str, torch.Tensor]:
    """A collated batch's model inputs by graph input name, as the Predictor takes them."""
    names, tensors, _ = flat_inputs(batch)
    return dict(zip(names, tensors, strict=True))


def _parity(predict: Any, samples: list[Any], expected: Any, data: dict[str, Any]) -> dict[str, Any]:
    """The artifact's outputs on ``samples`` against the tuned model's (the export's tolerance,
    per output) and against the baseline's (the guard's fidelity)."""
    from torch.utils.data import default_collate

    from autotune.trial.fidelity import attention_mask

    def cpu(out: Any) -> Any:
        return map_tensors(lambda t: t.cpu().float() if t.is_floating_point() else t.cpu(), out)

    kinds, mask = data.get("kinds"), attention_mask(samples)
    if data.get("chunks"):
        # Outputs that change shape with the batch: the guard's own batches, one output each.
        from autotune.shapes import Batches

        chunk = expected.chunk if isinstance(expected, Batches) else len(samples)
        outputs = Batches([cpu(predict(_named_inputs(b))) for b in data["chunks"]], chunk=chunk)
    elif data.get("batches"):
        # Token sequences: the winner's own batches, each sample's output cut to its real tokens.
        from autotune.batching.outputs import join_samples, split_samples

        pieces: list[Any] = [None] * len(samples)
        for entry in data["batches"]:
            out = cpu(predict(_named_inputs(entry["batch"])))
            tokens = data.get("tokens") or ()
            for i, piece in zip(entry["ids"], split_samples(out, entry["batch"], tokens), strict=False):
                pieces[i] = piece
        outputs, mask = join_samples(pieces)[0], data.get("mask")
    else:
        outputs = cpu(predict(_named_inputs(default_collate(samples))))
    max_abs, rel_l2, mismatch = _errors(outputs, expected)
    reason = mismatch
    if reason is None and not rel_l2 <= _RTOL_L2:
        reason = f"an output differs from the tuned model's by a relative L2 error of {rel_l2:.3g} > {_RTOL_L2:g}"
    kept = None
    if mismatch is None and data.get("baseline") is not None:
        kept = fidelity(outputs, data["baseline"], kinds, mask)
        if reason is None and not 1.0 - kept <= data["max_metric_drop"]:
            reason = f"its fidelity to the untuned model is {kept:.4g}, more than {data['max_metric_drop']:g} below 1"
    return {
        "max_abs": _finite(max_abs),
        "rel_l2": _finite(rel_l2),
        "fidelity": fidelity(outputs, expected, kinds, mask) if mismatch is None else 0.0,
        "baseline_fidelity": kept,
        "ok": reason is None,
        "reason": reason,
    }


def _throughput(predict: Any, samples: list[Any], n_batches: int, batches: list | None = None) -> float:
    """Samples/s of ``predict`` alone on ``n_batches`` full batches: the median of a few repeats
    (token sequences: on the winner's own batches, ``batches``)."""
    from torch.utils.data import default_collate

    size = predict.batch_size
    # A few distinct batches, cycled: enough to not time one cached input, few enough to fit.
    n_distinct = max(1, min(n_batches, math.ceil(len(samples) / size)))
    pool = []
    for k in range(n_distinct):
        if batches:
            batch = _named_inputs(batches[k % len(batches)]["batch"])
        else:
            part = [samples[(k * size + j) % len(samples)] for j in range(size)]
            batch = _named_inputs(default_collate(part))
        pool.append({name: t.to(predict.device) for name, t in batch.items()})

    def sync() -> None:
        if predict.device.type == "cuda":
            torch.cuda.synchronize(predict.device)

    for k in range(_N_WARMUP):
        predict(pool[k % n_distinct])
    rates = []
    for _ in range(_N_REPEATS):
        sync()
        start = time.perf_counter()
        for k in range(n_batches):
            predict(pool[k % n_distinct])
        sync()
        rates.append(n_batches * size / max(time.perf_counter() - start, 1e-9))
    return statistics.median(rates)


def _check_one(
    out_dir: Path, fmt: str, record: dict[str, Any], parity: dict[str, Any], device: str, n_batches: int
) -> dict[str, Any]:
    result: dict[str, Any] = {"status": "failed", "batch_size": record.get("batch_size")}
    result.update(dict.fromkeys(("max_abs", "rel_l2", "fidelity", "baseline_fidelity", "samples_per_s", "reason")))
    recorded_error = record.get("error") or "no reason recorded"
    path = out_dir / str(record.get("path") or "")
    if not record.get("path") or not path.is_file():
        if not record.get("sha256") and record.get("status") != "ok":  # the export failed: no file was kept
            return {**result, "reason": f"the export failed: {recorded_error}"}
        name = record.get("path") or f"the {fmt} file"
        return {**result, "status": "missing", "reason": f"{name} is missing from {str(out_dir)!r}"}
    # The file (an OpenVINO artifact: and its weights file) as exported and checked.
    modified = file_digest(path) != record.get("sha256") or bool(_modified(path, record))
    try:
        with warnings.catch_warnings():  # loading a failed artifact warns; the report says it
            warnings.simplefilter("ignore")
            predict = load(out_dir, format=fmt, device=device, allow_modified=True)
        samples = parity["samples"]
        check = _parity(predict, samples, parity["by_format"].get(fmt, parity["outputs"]), parity)
        result.update({k: check[k] for k in ("max_abs", "rel_l2", "fidelity", "baseline_fidelity")})
        result["samples_per_s"] = _throughput(predict, samples, n_batches, parity.get("batches"))
        reason = check["reason"]
    except Exception as exc:  # any failure of the artifact is its verdict, not verify's crash
        reason = f"the artifact raised {describe_error(exc)}"
    if modified:
        why = f"; and {reason}" if reason else ""
        return {**result, "status": "modified", "reason": f"its sha256 differs from the recorded one{why}"}
    if reason is not None and record.get("form_note"):
        reason += f" (exported from another form of the model: {record['form_note']})"
    if reason is None and record.get("status") != "ok":
        reason = f"it failed its checks at export ({recorded_error}), although its outputs match here"
    return {**result, "status": "ok" if reason is None else "failed", "reason": reason}


def _packaged() -> list[Runtime]:
    """The runtimes with a package of their own (ONNX Runtime, OpenVINO), in their order."""
    return [REGISTRY[name] for name in names() if REGISTRY[name].packages]


def _version_keys() -> tuple[str, ...]:
    """The versions :func:`env_diff` compares: torch's, each packaged runtime's, Python's and CUDA's."""
    return ("torch", *(r.name for r in _packaged()), "python", "cuda")


def _versions_here() -> dict[str, str | None]:
    """Each packaged runtime's version here (the first of its wheels installed), or ``None``."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for runtime in _packaged():
        found[runtime.name] = None
        for dist in runtime.packages:
            try:
                found[runtime.name] = found[runtime.name] or metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    return found


def env_diff(recorded: dict[str, Any], current: dict[str, Any]) -> list[dict[str, Any]]:
    """The facts in :data:`ENV_KEYS` and the versions of torch, ONNX Runtime, OpenVINO, Python and CUDA
    that differ between two :meth:`~autotune.env.Env.manifest` dicts; a version the recorded
    manifest does not list is skipped (it was not recorded, so it cannot differ).

    Example:
        >>> env_diff({"cpu_threads": 8, "versions": {}}, {"cpu_threads": 4, "versions": {}})[0]["key"]
        'cpu_threads'
    """
    diff = []
    for key in ENV_KEYS:
        if recorded.get(key) != current.get(key):
            diff.append({"key": key, "recorded": recorded.get(key), "current": current.get(key)})
    old, new = recorded.get("versions") or {}, current.get("versions") or {}
    for key in _version_keys():
        if key in old and old[key] != new.get(key):
            diff.append({"key": f"versions.{key}", "recorded": old[key], "current": new.get(key)})
    return diff


def verify(out_dir: str | Path, *, device: str | None = None, n_batches: int = 20) -> dict[str, Any]:
    """Re-check every artifact of a tuning run on this machine.

    Each artifact listed in ``best_config.json`` is checked to be the file that was exported
    (its sha256), loaded with :func:`autotune.load` (failed ones too) and run on the validation
    samples in ``parity.pt``; each of its outputs must match the tuned model's there within the
    export's tolerance (relative L2 error <= 1e-2 against the output's own scale), and keep the
    guard's fidelity to the untuned model's outputs. Each is then timed alone.

    Args:
        out_dir: The run's directory.
        device: Where the artifacts run: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Default: the
            device the run was tuned on, or the CPU, with a warning, where this machine lacks it.
        n_batches: Timed batches of the artifact's batch size per repeat (after 3 warm-up
            batches; the median of 3 repeats is reported).

    Returns:
        ``{"artifacts": {fmt: {"status", "max_abs", "rel_l2", "fidelity", "baseline_fidelity", "samples_per_s",
        "batch_size", "reason"}}, "env_diff": [{"key", "recorded", "current"}],
        "recorded_samples_per_s", "device", "throughput_notes"}``. ``status`` is ``"ok"``,
        ``"failed"`` (its outputs differ, it raised, or it failed at export), ``"modified"``
        (the file changed since export) or ``"missing"``; ``reason`` says why in one line
        (``None`` when ok). ``samples_per_s`` is the artifact alone; ``recorded_samples_per_s``
        is the winner's end-to-end throughput in the search, data loading included: see
        :data:`THROUGHPUT_NOTES` before comparing them. Unmeasured numbers are ``None``.

    Raises:
        ConfigError: no such directory, no ``best_config.json`` or ``parity.pt``, no
            artifacts, an unknown device, or ``n_batches`` < 1.
    """
    from autotune.env import Env

    if isinstance(n_batches, bool) or not isinstance(n_batches, int) or n_batches < 1:
        raise ConfigError(f"`n_batches` must be an integer >= 1, but got {n_batches!r}.")
    out_dir = Path(out_dir)
    artifacts, best = _read_run(out_dir)
    parity = _read_parity(out_dir)
    env = Env.detect(
        run_device(out_dir) if device is None else device
    )  # raises for a device this machine lacks, before anything runs
    current = env.manifest()
    current["versions"].update(_versions_here())
    return {
        "artifacts": {
            fmt: _check_one(out_dir, fmt, record or {}, parity, env.device, n_batches)
            for fmt, record in artifacts.items()
        },
        "env_diff": env_diff(best.get("env") or {}, current),
        "recorded_samples_per_s": (best.get("best") or {}).get("samples_per_s"),
        "device": env.device,
        "throughput_notes": dict(THROUGHPUT_NOTES),
    }
