"""The artifacts of a tuned model, in every format a runtime writes (ONNX, TorchScript,
OpenVINO: :mod:`autotune.runtimes`), each checked for parity with the model on the validation
samples; the runtime of each format exports and runs its file.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> model = torch.nn.Linear(4, 2).eval()
    >>> samples = [torch.randn(4) for _ in range(6)]
    >>> out = export_artifacts(model, torch.randn(2, 4), samples, 2, Path(tempfile.mkdtemp()), ["torchscript"])
    >>> out["torchscript"]["status"]
    'ok'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.export import file_digest
from autotune.runtimes.base import Runtime, by_format
from autotune.runtimes.base import formats as known_formats

__all__ = ["export_artifacts", "ship_measured"]


def _export_one(
    runtime: Runtime,
    model: Any,
    example: Any,
    out_dir: Path,
    fallback: Any,
    check: dict,
    onnx_source: Any = None,
    spatial: bool = False,
) -> dict[str, Any]:
    from autotune.export.parity import check_parity, describe_error, device_of

    path = out_dir / runtime.file_name
    record: dict[str, Any] = {"path": path.name, "batch_size": check["batch_size"]}
    try:
        info, run = runtime.export(
            model, example, path, device=str(device_of(model)), fallback=fallback, source=onnx_source, spatial=spatial
        )
    except Exception as exc:  # a failed export is recorded, and must not lose the other format
        for file in (path, *runtime.files(path)):
            file.unlink(missing_ok=True)
        return {**record, "status": "failed", "error": describe_error(exc)}
    info.pop("path")
    record.update(bytes=path.stat().st_size, sha256=file_digest(path), **info)
    try:
        parity = check_parity(run, model, **check)
    except Exception as exc:  # a metric that raises on the artifact's outputs, say
        return {**record, "status": "failed", "error": f"the parity check raised {describe_error(exc)}"}
    record["parity"] = parity
    if not parity["ok"]:
        return {**record, "status": "failed", "error": f"parity: {parity['reason']}"}
    return {**record, "status": "ok"}


def ship_measured(
    artifact: dict[str, Any], module: Any, samples: list, batch_size: int, out_dir: Path, **check: Any
) -> dict[str, dict[str, Any]]:
    """Ship the very file a ``runtime=torchscript``, ``runtime=onnxruntime`` or ``runtime=openvino``
    winner ran when it was measured (an int8 graph stays int8; OpenVINO's IR with its weights
    file), with its session settings, and check it against that measured module and, through
    ``check``, against the baseline.

    Args:
        artifact: :attr:`autotune.trial.build.BuildState.artifact` of the winner's build.
        module: The module the trial measured (it runs ``artifact``'s file).
        samples: Validation samples (uncollated).
        batch_size: Samples per batch, recorded for loading.
        out_dir: Where the file goes.
        **check: Keyword arguments of :func:`~autotune.export.parity.check_parity`.

    Returns:
        ``{format: record}`` as :func:`export_artifacts` writes it, with ``"winner": True``.
    """
    import shutil

    from autotune.export.parity import check_parity, describe_error

    fmt = artifact["format"]
    runtime = by_format(fmt)
    path = Path(out_dir) / runtime.file_name
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(artifact["path"], path)
    record: dict[str, Any] = {k: v for k, v in artifact.items() if k not in ("format", "path")}
    record.update(path=path.name, batch_size=batch_size, bytes=path.stat().st_size, sha256=file_digest(path))
    runtime.ship_files(Path(artifact["path"]), path, record)
    record.update(winner=True, measured_as="the winner's own file, as measured in the search")
    run = runtime.open_file(path, artifact)
    try:
        parity = check_parity(run, module, samples, batch_size, **check)
    except Exception as exc:
        return {fmt: {**record, "status": "failed", "error": f"the parity check raised {describe_error(exc)}"}}
    record["parity"] = parity
    if not parity["ok"]:
        return {fmt: {**record, "status": "failed", "error": f"parity: {parity['reason']}"}}
    return {fmt: {**record, "status": "ok"}}


def export_artifacts(
    model: Any,
    example: Any,
    samples: list,
    batch_size: int,
    out_dir: Path,
    formats: Sequence[str],
    *,
    fallback: Any = None,
    metric: Callable[[Any, Any], float] | None = None,
    baseline_metric: float | None = None,
    max_metric_drop: float = 0.01,
    onnx_source: tuple[Any, ...] | None = None,
    baseline_outputs: Any = None,
    kinds: list[str] | None = None,
    mask: Any = None,
    metric_chunk: int | None = None,
    batching: Any = None,
    spatial: bool = False,
    memo: dict[int, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write ``model.onnx`` / ``model.pt`` into ``out_dir`` and check each against ``model``.

    A failed export or parity check is recorded in the format's entry (``status: "failed"``,
    ``error``), never raised; one format failing leaves the others as they are.

    Args:
        model: The tuned model, in eval mode, on its device.
        example: One collated batch on the model's device.
        samples: Validation samples (uncollated) for the parity check.
        batch_size: Samples per batch, recorded for loading.
        out_dir: Where the files go.
        formats: Any of ``"onnx"``, ``"torchscript"``, ``"openvino"`` (``model.xml`` and
            ``model.bin``: the model converted by OpenVINO in float32).
        fallback: For TorchScript: the nearest traceable form of ``model`` (see
            :func:`~autotune.export.torchscript.export_torchscript`).
        metric: ``metric(outputs, batch) -> float`` for the parity check; ``None`` compares
            outputs alone.
        baseline_metric: The metric the artifact must keep; ``None`` scores ``model``.
        max_metric_drop: The largest metric drop that passes.
        onnx_source: ``(float model, method, calibration batches[, how])``: export the float
            model and quantize the graph with ONNX Runtime's ``method`` instead of exporting
            ``model`` (a torch-quantized model the exporters cannot take); ``how`` may hold
            ``per_channel``, and ``keep`` (with ``plan``, ``config`` and ``fallback``, the
            caller's :func:`autotune.compress.fallback.onnx_with_fallback`): an ``int8_fallback``
            value, the layers kept float ranked on the graph as that knob ranks them.
        baseline_outputs, kinds, mask, metric_chunk, batching: The untuned model's outputs on
            ``samples`` and how the guard judges them, and for token sequences how the winner
            batches them (see :func:`~autotune.export.parity.check_parity`).
        spatial: The images vary in size: the ONNX graph takes any height and width.
        memo: The reference outputs already computed (see
            :func:`~autotune.export.parity.check_parity`), shared with the caller's other
            checks; default: shared among ``formats`` alone.

    Returns:
        Per format: ``{"path"`` (file name in ``out_dir``), ``"bytes", "sha256", "batch_size",``
        the exporter's details (ONNX: ``opset``, ``exporter``, ``fallback_reason``,
        ``simplified``, ``input_names``, ``output_names``, ``ort``; TorchScript: ``form``,
        ``frozen``, ``optimized``, ``reason``, ``input_names``), ``"parity"`` (see
        :func:`~autotune.export.parity.check_parity`), ``"status"`` (``"ok"`` or
        ``"failed"``) and, when failed, ``"error"``.

    Raises:
        ConfigError: an unknown format.
    """
    unknown = [f for f in formats if f not in known_formats()]
    if unknown:
        raise ConfigError(f"No artifact format named {unknown[0]!r}. Known: {', '.join(known_formats())}.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check = {
        "samples": samples,
        "batch_size": batch_size,
        "metric": metric,
        "baseline_metric": baseline_metric,
        "max_metric_drop": max_metric_drop,
        "baseline_outputs": baseline_outputs,
        "kinds": kinds,
        "mask": mask,
        "metric_chunk": metric_chunk,
        "batching": batching,
        "memo": {} if memo is None else memo,  # the model's outputs, computed for the first format
    }
    return {
        fmt: _export_one(by_format(fmt), model, example, out_dir, fallback, check, onnx_source, spatial)
        for fmt in dict.fromkeys(formats)
    }
