"""Deployable artifacts of a tuned model: ONNX, TorchScript and OpenVINO files, each checked for
parity with the model on the validation samples.

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

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = ["FILE_NAMES", "FORMATS", "ORT_DEFAULTS", "export_artifacts", "file_digest", "ship_measured"]

FORMATS = ("onnx", "torchscript", "openvino")
# An OpenVINO artifact is two files: the IR's ``model.xml`` and its weights, ``model.bin``, beside it.
FILE_NAMES = {"onnx": "model.onnx", "torchscript": "model.pt", "openvino": "model.xml"}
# The ONNX Runtime settings an exported ONNX artifact is checked (and later loaded) with.
ORT_DEFAULTS = {"provider": "CPUExecutionProvider", "graph_optimization": "all", "intra_op_threads": 0}


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _example_outputs(model: Any, example: Any) -> Any:
    import torch

    from autotune.samples import model_inputs

    args, kwargs = model_inputs(example)
    with torch.no_grad():
        return model(*args, **kwargs)


def _onnx_runner(
    model: Any, example: Any, path: Path, device: str, source: Any = None, spatial: bool = False
) -> tuple[dict[str, Any], Callable[..., Any]]:
    from autotune.export.onnx import OrtModule, export_onnx, quantize_onnx
    from autotune.export.ort import provider_for
    from autotune.export.parity import restore_like

    if source is None:
        info = export_onnx(model, example, path, spatial=spatial)
    else:
        # The nearest exportable form (the pruned float model), quantized on the ONNX side with
        # the winner's method; parity is still measured against the tuned model.
        float_model, method, calibration, *rest = source
        how = rest[0] if rest else {}
        src = path.with_suffix(".float.onnx")
        info = export_onnx(float_model, example, src, spatial=spatial)
        try:
            if how.get("keep"):  # layers kept float on the graph, ranked by ONNX Runtime's own int8 error
                config = {**how.get("config", {}), "int8_per_channel": how.get("per_channel", False)}
                kept = how["fallback"](src, path, method, how["keep"], calibration, how.get("plan"), config)
                info["quantized"] = {"method": method, "kept_float": kept["int8_kept"]}
            else:
                per_channel = how.get("per_channel", False)
                info["quantized"] = quantize_onnx(src, path, method, calibration, per_channel=per_channel)
        finally:
            src.unlink(missing_ok=True)
    # The provider a session on this device really gets here: the CPU's where ONNX Runtime has no
    # working CUDA provider, so the record says what the check ran on.
    ort = dict(ORT_DEFAULTS, provider=provider_for(device))
    on_gpu = ort["provider"] != ORT_DEFAULTS["provider"]
    runner = OrtModule(path, info["input_names"], info["output_names"], io_binding=on_gpu, **ort)
    template = _example_outputs(model, example)

    def run(*args: Any, **kwargs: Any) -> Any:
        # The graph's outputs are flat; a metric expects the model's own structure.
        return restore_like(template, runner(*args, **kwargs))

    info.update(ort=ort)
    return info, run


def _openvino_runner(
    model: Any, example: Any, path: Path, spatial: bool = False
) -> tuple[dict[str, Any], Callable[..., Any]]:
    from autotune.export.openvino import OvModule, convert_openvino, save_openvino
    from autotune.export.parity import restore_like

    converted, info = convert_openvino(model, example, spatial=spatial, onnx_path=path.with_suffix(".onnx"))
    path.with_suffix(".onnx").unlink(missing_ok=True)
    save_openvino(converted, path)
    runner = OvModule(path, info["input_names"], info["output_names"])  # the saved files are what ship
    template = _example_outputs(model, example)
    info.update(
        path=str(path), bin_path=path.with_suffix(".bin").name, bin_sha256=file_digest(path.with_suffix(".bin"))
    )

    def run(*args: Any, **kwargs: Any) -> Any:
        return restore_like(template, runner(*args, **kwargs))

    return info, run


def _torchscript_runner(
    model: Any, example: Any, path: Path, fallback: Any
) -> tuple[dict[str, Any], Callable[..., Any]]:
    import torch

    from autotune.export.torchscript import export_torchscript, positional_inputs

    info = export_torchscript(model, example, path, fallback=fallback)
    loaded = torch.jit.load(str(path))  # the saved file is what ships, so it is what is checked

    def run(*args: Any, **kwargs: Any) -> Any:
        return loaded(*positional_inputs(info["input_names"], args, kwargs))

    return info, run


def _export_one(
    fmt: str,
    model: Any,
    example: Any,
    out_dir: Path,
    fallback: Any,
    check: dict,
    onnx_source: Any = None,
    spatial: bool = False,
) -> dict[str, Any]:
    from autotune.export.parity import check_parity, describe_error, device_of

    path = out_dir / FILE_NAMES[fmt]
    record: dict[str, Any] = {"path": path.name, "batch_size": check["batch_size"]}
    try:
        if fmt == "onnx":
            info, run = _onnx_runner(model, example, path, str(device_of(model)), onnx_source, spatial)
        elif fmt == "openvino":
            info, run = _openvino_runner(model, example, path, spatial)
        else:
            info, run = _torchscript_runner(model, example, path, fallback)
    except Exception as exc:  # a failed export is recorded, and must not lose the other format
        path.unlink(missing_ok=True)
        if fmt == "openvino":
            path.with_suffix(".bin").unlink(missing_ok=True)
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
    path = Path(out_dir) / FILE_NAMES[fmt]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(artifact["path"], path)
    record: dict[str, Any] = {k: v for k, v in artifact.items() if k not in ("format", "path")}
    record.update(path=path.name, batch_size=batch_size, bytes=path.stat().st_size, sha256=file_digest(path))
    if fmt == "openvino":
        weights = path.with_suffix(".bin")
        shutil.copyfile(Path(artifact["path"]).with_suffix(".bin"), weights)
        record.update(
            bin_path=weights.name, bin_sha256=file_digest(weights), bytes=record["bytes"] + weights.stat().st_size
        )
    record.update(winner=True, measured_as="the winner's own file, as measured in the search")
    if fmt == "onnx":
        from autotune.export.onnx import OrtModule

        ort = artifact["ort"]
        run: Any = OrtModule(path, artifact["input_names"], artifact["output_names"], **ort)
    elif fmt == "openvino":
        from autotune.export.openvino import OvModule

        run = OvModule(path, artifact["input_names"], artifact["output_names"], **artifact["openvino"])
    else:
        import torch

        from autotune.export.torchscript import ScriptRunner

        run = ScriptRunner(torch.jit.load(str(path)), artifact["input_names"])
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
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ConfigError(f"No artifact format named {unknown[0]!r}. Known: {', '.join(FORMATS)}.")
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
        fmt: _export_one(fmt, model, example, out_dir, fallback, check, onnx_source, spatial)
        for fmt in dict.fromkeys(formats)
    }
