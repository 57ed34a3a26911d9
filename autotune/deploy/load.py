"""An exported artifact of a tuning run behind a plain call (:class:`Predictor`), and reading
the run's artifacts; :func:`autotune.deploy.serve.load` chooses which one to serve.

Example:
    >>> predict = autotune.load("autotune_out")  # doctest: +SKIP
    >>> predict(images).shape  # numpy in, numpy out  # doctest: +SKIP
    (1000, 10)
"""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autotune.deploy.light import (  # noqa: F401  (their former home: serve and verify import them here)
    _check_files,
    _inside,
    _is_winner,
    _not_the_winner,
    _read_artifacts,
)
from autotune.errors import ConfigError, InputError
from autotune.export.stored import from_stored, rebuild_output
from autotune.runtimes.base import by_format, formats, of_format
from autotune.samples import concat_outputs, map_tensors, pad_batch, slice_batch

__all__ = ["Predictor", "run_device"]


class Predictor:
    """An exported artifact behind a plain call: arrays or tensors in, the same kind out.

    Inputs run in chunks of the tuned batch size (TorchScript's last one padded to it, as the
    artifact was checked; ONNX and OpenVINO graphs take it as it is), and the outputs are
    concatenated.

    Attributes:
        format: ``"onnx"``, ``"torchscript"`` or ``"openvino"``.
        path: The artifact file.
        batch_size: Samples per chunk.
        device: Where the artifact runs.
        input_names: The artifact's inputs, in positional order.
        record: The artifact's entry in ``best_config.json``.
        chosen: Which artifact :func:`load` took and why (the fastest here, or the one asked for).
    """

    def __init__(self, module: Any, fmt: str, path: Path, record: dict[str, Any], batch_size: int, device: str) -> None:
        self.module = module
        self.format = fmt
        self.path = path
        self.record = record
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.input_names: list[str] = list(record["input_names"])
        self.chosen = f"{fmt}: asked for" if record else fmt
        self.run: dict[str, Any] = {}  # best_config.json's config and data, for predict()

    def __repr__(self) -> str:
        return f"Predictor(format={self.format!r}, path={str(self.path)!r}, batch_size={self.batch_size}, device={str(self.device)!r})"

    def _positional(self, inputs: Any) -> list[Any]:
        from autotune.deploy.light import positional_inputs

        return positional_inputs(inputs, self.input_names)

    def _structured(self, out: Any) -> Any:
        """The model's own output structure from every format: an ONNX graph returns its outputs
        flat, where TorchScript keeps a dict; both give the dict of the model's keys."""
        names = list(self.record.get("output_names") or [])
        runtime = of_format(self.format)  # None for the torch model itself
        if (
            runtime is not None
            and runtime.flat_outputs
            and isinstance(out, tuple)
            and names
            and not names[0].startswith("output")
        ):
            return dict(zip(names, out, strict=True))
        return out

    def __call__(self, inputs: Any = None, /, **kwargs: Any) -> Any:
        """Run a batch, given as the model takes it: ``pred(batch)`` with an array/tensor, a tuple
        of them by position or a dict of them by input name, or ``pred(**batch)`` by keyword.
        Numpy in gives numpy out, torch in gives torch out (on the inputs' device); the outputs
        keep the model's structure (a dict of the model's keys stays one) from every format."""
        if kwargs:
            if inputs is not None:
                raise InputError("Pass the inputs either as one batch or by keyword, not both.")
            inputs = kwargs
        values = self._positional(inputs)
        as_numpy = any(isinstance(v, np.ndarray) for v in values)
        home = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
        tensors = [(torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for v in values]
        if not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors):
            raise InputError("Every input must be an array or tensor with a batch axis.")
        sizes = {int(t.shape[0]) for t in tensors}
        if len(sizes) != 1 or 0 in sizes:
            raise InputError(f"Inputs must share one non-zero batch size, but have {sorted(sizes)}.")
        n = sizes.pop()
        runtime = of_format(self.format)  # None for the torch model itself
        chunks, fixed = [], runtime is not None and runtime.fixed_batch
        with torch.inference_mode():
            for start in range(0, n, self.batch_size):
                part = [t[start : start + self.batch_size].to(self.device) for t in tensors]
                size = int(part[0].shape[0])
                # A traced TorchScript graph may hold its batch size: it gets full chunks, as it
                # was checked. ONNX and OpenVINO graphs have a dynamic batch axis, and a short
                # chunk runs at its own size, as the trials ran it: padded, a last chunk of 12
                # computed 32 rows (7% of a real-text pass), and dynamic int8 scaled the zeros too.
                fed = pad_batch(part, self.batch_size) if fixed else part
                out = self._structured(self.module(*fed))
                chunks.append(slice_batch(out, size))
        out = map_tensors(lambda t: t.to(home), concat_outputs(chunks))
        if self.record.get("output_type") and isinstance(out, dict):  # the model's ModelOutput, as apply() gives
            out = rebuild_output(self.record["output_type"], out)
        return map_tensors(lambda t: t.numpy(), out) if as_numpy else out

    def predict(self, samples: Sequence[Any], collate_fn: Any = None) -> list[Any]:
        """Every sample's output, in the order given, batched as the run's winner batches: its
        batch size, padding and length grouping (``best_config.json``). Each output is the
        sample's own, without a batch axis; token-level outputs keep the real tokens only.

        Args:
            samples: Samples as the dataset gives them (dicts of tensors, or a tokenizer's lists
                of ints, for text), or a DataLoader over them: its dataset and its collate.
            collate_fn: The run's own collate, when it had one (it is not saved with the run);
                a run that padded token sequences itself pads them the same way here.
        """
        from autotune.deploy.samples import predict_samples

        return predict_samples(self, samples, collate_fn)


def run_device(out_dir: Path) -> str:
    """The device the run in ``out_dir`` was tuned on (``best_config.json``'s ``env.device``), where
    this machine has it; else the CPU, with a one-line warning (a CUDA run loaded on a machine
    without CUDA, say). A run that recorded none, or none that can be read: the CPU.

    Example:
        >>> run_device(Path("no-such-run"))
        'cpu'
    """
    from autotune.env import resolve_device

    try:
        best = json.loads((Path(out_dir) / "best_config.json").read_text())
        recorded = best["env"]["device"]
    except (OSError, ValueError, TypeError, KeyError):
        return "cpu"  # the reader that needs the file says what is wrong with it
    if not isinstance(recorded, str):
        return "cpu"
    try:
        return resolve_device(recorded)
    except ConfigError:
        warnings.warn(
            f"The run in {str(out_dir)!r} was tuned on {recorded!r}, which this machine lacks: it runs on the "
            "CPU here (pass device= to choose).",
            stacklevel=3,
        )
        return "cpu"


def _read_parity(out_dir: Path) -> dict[str, Any]:
    """What ``parity.pt`` holds: the validation samples, the tuned model's outputs (and those of
    any other form an artifact was exported from), the baseline's outputs and their kinds."""
    path = out_dir / "parity.pt"
    if not path.is_file():
        raise ConfigError(
            f"No parity.pt in {str(out_dir)!r}: it is written with the artifacts; run the tuning again "
            "with export formats to have one."
        )
    # weights_only with no added globals: an out dir may come from anywhere, and unpickling runs
    # code. The export writes tensors, numbers and strings only (numpy samples become tensors,
    # a ModelOutput a dict with its class's path, rebuilt here: autotune.export.stored).
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ConfigError(
            f"{str(path)!r} holds objects other than tensors, numbers and strings; verify does not unpickle "
            "them, as that could run any code. Export the run again with this version of autotune."
        ) from None
    except Exception as exc:
        raise ConfigError(f"Cannot read {str(path)!r}: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or not data.get("samples") or "outputs" not in data:
        raise ConfigError(f"{str(path)!r} must hold {{'samples': [...], 'outputs': ...}}: export the run again.")
    data = from_stored(data)
    return {
        "samples": list(data["samples"]),
        "outputs": data["outputs"],
        # An artifact exported from another form than the tuned model (a CPU bfloat16 winner's
        # float32 ONNX) is compared with that form's outputs, as its export was.
        "by_format": data.get("outputs_by_format") or {},
        "baseline": data.get("baseline_outputs"),
        "kinds": data.get("kinds"),
        "max_metric_drop": data.get("max_metric_drop", 0.01),
        # Token sequences: the winner's batches ({"ids", "batch"}) and the real-token mask.
        "batches": data.get("batches"),
        "mask": data.get("mask"),
        # Outputs that change shape with the batch: the guard's batches, as collated.
        "chunks": data.get("chunks"),
    }


def _choose(artifacts: dict[str, Any], fmt: str | None, where: Path) -> tuple[str, dict[str, Any]]:
    if fmt is not None:
        by_format(fmt)  # an unknown format is refused, the known ones listed
        if fmt not in artifacts:
            raise ConfigError(f"{str(where)!r} has no {fmt} artifact. It has: {', '.join(artifacts)}.")
        if artifacts[fmt].get("status") != "ok":
            error = artifacts[fmt].get("error") or "no reason recorded"
            warnings.warn(f"Loading the {fmt} artifact although it failed its checks: {error}", stacklevel=3)
        return fmt, artifacts[fmt]
    for name in formats():  # ONNX first: it runs without Python's model code or torch
        if (artifacts.get(name) or {}).get("status") == "ok":
            return name, artifacts[name]
    failed = "; ".join(f"{k}: {(v or {}).get('error') or 'failed'}" for k, v in artifacts.items())
    raise ConfigError(
        f"No artifact in {str(where)!r} passed its checks ({failed}). Pass format='onnx' or "
        "format='torchscript' to load one anyway."
    )


def _open(fmt: str, path: Path, record: dict[str, Any], device: str) -> Any:
    """The module that serves the ``fmt`` artifact at ``path`` on ``device``: its runtime's."""
    return by_format(fmt).open(path, record, device)


def _load_one(
    out_dir: Path, fmt: str, record: dict[str, Any], run_batch_size: Any, device: str, allow_modified: bool
) -> Predictor:
    path = _inside(out_dir, record.get("path"), fmt)
    _check_files(path, record, fmt, allow_modified)
    if "input_names" not in record:
        raise ConfigError(f"The {fmt} artifact's entry in best_config.json lacks `input_names`: export it again.")
    from autotune.deploy.light import artifact_batch_size, run_of

    batch_size = artifact_batch_size(record, run_batch_size, fmt)
    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"`device` must be 'cpu' or 'cuda[:N]', but got {device!r}.") from None
    predictor = Predictor(_open(fmt, path, record, device), fmt, path, record, batch_size, device)
    run = run_of(out_dir)
    if run is not None:
        predictor.run = run
    return predictor
