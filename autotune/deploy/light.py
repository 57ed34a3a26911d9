"""Serving an artifact without torch (:class:`LightPredictor`), and reading a run's directory
without torch: its artifacts, their files inside it, which one is the winner
(:mod:`autotune.deploy.load` re-exports these helpers).

A runtime whose file runs with numpy alone (``runs_without_torch``: an OpenVINO winner's IR runs
with ``openvino`` and ``numpy``) opens it for :func:`autotune.deploy.entry.load` through its
:meth:`~autotune.runtimes.base.Runtime.open_light`.

Example:
    >>> predict = autotune.load("autotune_out", format="openvino")  # doctest: +SKIP
    >>> predict(batch)  # numpy in, numpy out  # doctest: +SKIP
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError, InputError
from autotune.export import file_digest
from autotune.runtimes.base import Runtime, by_format, formats

__all__ = ["LightPredictor", "open_light"]


def _light_runtimes() -> list[Runtime]:
    """The runtimes whose files run without torch, in the order a load prefers their formats."""
    return [r for r in map(by_format, formats()) if r.runs_without_torch]


def open_light(out_dir: Path, fmt: str | None, device: str | None, allow_modified: bool) -> LightPredictor:
    """The run's artifact that runs without torch as a :class:`LightPredictor`: asked for (``fmt``,
    a format whose runtime ``runs_without_torch``), or (``fmt=None``) the first of those that
    passed its checks.

    Raises:
        ConfigError: no such artifact (or, unasked, none that passed its checks), ``device``
            other than the CPU, its files missing, outside ``out_dir`` or changed since export.
    """
    runtimes = _light_runtimes() if fmt is None else [by_format(fmt)]
    kinds = " or ".join(r.title or r.name for r in runtimes)
    if device is not None and str(device) != "cpu":
        raise ConfigError(f"An {kinds} artifact runs on the CPU, but device={device!r} was given: pass device='cpu'.")
    artifacts, run_batch_size = _read_artifacts(out_dir)
    if fmt is None:
        passed = [r for r in runtimes if (artifacts.get(r.format) or {}).get("status") == "ok"]
        if not passed:
            one = "the one kind that runs" if len(runtimes) == 1 else "the kinds that run"
            raise ConfigError(
                f"torch is not installed here, and {str(out_dir)!r} has no {kinds} artifact that passed its checks, "
                f"{one} without it. Install torch to serve the others."
            )
        runtime = passed[0]
        fmt, record = runtime.format, artifacts[runtime.format]
        chosen = (
            f"{fmt}: served untimed, as torch is not installed here and only the {runtime.title or runtime.name} "
            "artifact runs without it"
        )
    else:
        runtime, record = runtimes[0], artifacts.get(fmt)
        if not record:
            raise ConfigError(f"{str(out_dir)!r} has no {fmt} artifact. It has: {', '.join(artifacts)}.")
        if record.get("status") != "ok":
            error = record.get("error") or "no reason recorded"
            warnings.warn(f"Loading the {fmt} artifact although it failed its checks: {error}", stacklevel=3)
        chosen = f"{fmt}: asked for"
    path = _inside(out_dir, record.get("path"), fmt)
    _check_files(path, record, fmt, allow_modified)
    if "input_names" not in record:
        raise ConfigError(f"The {fmt} artifact's entry in best_config.json lacks `input_names`: export it again.")
    module = runtime.open_light(path, record)
    predictor = LightPredictor(module, fmt, path, record, artifact_batch_size(record, run_batch_size, fmt))
    predictor.chosen = chosen + _not_the_winner(record)
    predictor.run = run_of(out_dir) or {}
    return predictor


def artifact_batch_size(record: Mapping[str, Any], run_batch_size: Any, fmt: str) -> int:
    """The batch size an artifact was exported for (its own record's, else the run's).

    Raises:
        ConfigError: neither records a positive one.
    """
    batch_size = record.get("batch_size") or run_batch_size
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"The {fmt} artifact records no batch size (got {batch_size!r}): export it again.")
    return batch_size


def run_of(out_dir: Path) -> dict[str, Any] | None:
    """The winner's configuration and data facts from ``best_config.json``, or ``None``."""
    try:
        best = json.loads((out_dir / "best_config.json").read_text())
    except (OSError, ValueError):
        return None
    return {"config": best.get("config") or {}, "data": best.get("data") or {}}


class LightPredictor:
    """An artifact behind a plain call, without torch: numpy arrays in and out (torch tensors in
    give torch tensors out, as :class:`~autotune.deploy.load.Predictor`'s do). Its runtime's
    :meth:`~autotune.runtimes.base.Runtime.open_light` runs the file.

    Inputs run in chunks of the tuned batch size, the last one padded to it (its last sample
    repeated), and the outputs are concatenated. One output comes back as an array; several as a
    tuple, or as a dict when the model returned one. The outputs of a model that returned a
    transformers ``ModelOutput`` come back as that class where torch is imported already, else
    as a plain dict.

    Attributes:
        format: The artifact's format (``"openvino"``).
        path: Its file (``model.xml``).
        batch_size: Samples per chunk.
        device: ``"cpu"``.
        input_names: The inputs, in positional order.
        record: The artifact's entry in ``best_config.json``.
        chosen: Which artifact :func:`load` took and why.
    """

    def __init__(self, module: Any, fmt: str, path: Path, record: dict[str, Any], batch_size: int) -> None:
        self.module, self.format = module, fmt
        self.path, self.record, self.batch_size, self.device = Path(path), record, batch_size, "cpu"
        self.input_names: list[str] = list(record["input_names"])
        self.output_names: list[str] = list(record.get("output_names") or [])
        self.chosen = fmt
        self.run: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"LightPredictor(format={self.format!r}, path={str(self.path)!r}, batch_size={self.batch_size})"

    def _positional(self, inputs: Any) -> list[Any]:
        return positional_inputs(inputs, self.input_names)

    def __call__(self, inputs: Any = None, /, **kwargs: Any) -> Any:
        """Run a batch: ``pred(batch)`` with an array, a tuple of arrays by position or a dict by
        input name, or ``pred(**batch)`` by keyword."""
        import numpy as np

        if kwargs:
            if inputs is not None:
                raise InputError("Pass the inputs either as one batch or by keyword, not both.")
            inputs = kwargs
        values = self._positional(inputs)
        as_torch = any(_is_torch(v) for v in values)
        arrays = [_to_numpy(v) for v in values]
        if not all(a.ndim > 0 for a in arrays):
            raise InputError("Every input must be an array or tensor with a batch axis.")
        sizes = {int(a.shape[0]) for a in arrays}
        if len(sizes) != 1 or 0 in sizes:
            raise InputError(f"Inputs must share one non-zero batch size, but have {sorted(sizes)}.")
        n = sizes.pop()
        chunks = []
        for start in range(0, n, self.batch_size):
            part = [a[start : start + self.batch_size] for a in arrays]
            size = int(part[0].shape[0])
            padded = [np.concatenate([p, np.repeat(p[-1:], self.batch_size - size, axis=0)]) for p in part]
            chunks.append(
                [o[:size] if o.ndim and o.shape[0] == self.batch_size else o for o in self.module.run(padded)]
            )
        outs = [
            np.concatenate([c[j] for c in chunks]) if chunks[0][j].ndim else chunks[0][j] for j in range(len(chunks[0]))
        ]
        if as_torch:
            import torch

            outs = [torch.from_numpy(o) for o in outs]
        return self._structured(outs)

    def _structured(self, outs: list[Any]) -> Any:
        names = self.output_names
        if len(outs) > 1 and names and not names[0].startswith("output"):
            out: Any = dict(zip(names, outs, strict=True))
            if self.record.get("output_type") and "torch" in sys.modules and sys.modules["torch"] is not None:
                from autotune.export.stored import rebuild_output

                out = rebuild_output(self.record["output_type"], out)
            return out
        return outs[0] if len(outs) == 1 else tuple(outs)

    def predict(self, samples: Sequence[Any], collate_fn: Any = None) -> list[Any]:
        """Every sample's output, batched as the run's winner batches: see
        :meth:`autotune.deploy.load.Predictor.predict` (it needs torch, as samples are tensors)."""
        from autotune.deploy.samples import predict_samples

        return predict_samples(self, samples, collate_fn)


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def positional_inputs(inputs: Any, input_names: Sequence[str]) -> list[Any]:
    """An artifact's inputs in its order: one array or tensor, a tuple or list of them, or a dict
    by input name.

    Raises:
        InputError: a name the artifact takes is missing, or the inputs are of another kind.
    """
    if _is_array(inputs):
        return [inputs]
    if isinstance(inputs, (tuple, list)):
        return list(inputs)
    if isinstance(inputs, Mapping):
        missing = [n for n in input_names if n not in inputs]
        if missing:
            raise InputError(
                f"Inputs lack {', '.join(map(repr, missing))}. The artifact takes: {', '.join(input_names)}."
            )
        return [inputs[n] for n in input_names]
    raise InputError(
        f"Inputs must be a numpy array or torch tensor, or a tuple/dict of them, but got {type(inputs).__name__}."
    )


def _is_array(value: Any) -> bool:
    return _is_torch(value) or type(value).__module__ == "numpy"


def _to_numpy(value: Any) -> Any:
    import numpy as np

    if _is_torch(value):
        value = value.detach().cpu()
        return (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()
    return np.ascontiguousarray(value)


# --- reading a run's directory (torch-free; re-exported by autotune.deploy.load) ----------------


def _read_artifacts(out_dir: Path, required: bool = True) -> tuple[dict[str, Any], int | None]:
    """The ``artifacts`` entry of ``best_config.json`` and the run's batch size (no artifacts is
    an error when ``required``: without the original model there is nothing else to serve)."""
    if not out_dir.is_dir():
        raise ConfigError(f"No directory {str(out_dir)!r}: give the out_dir that autotune.optimize wrote.")
    path = out_dir / "best_config.json"
    if not path.is_file():
        raise ConfigError(f"No best_config.json in {str(out_dir)!r}: give the out_dir that autotune.optimize wrote.")
    try:
        best = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"Cannot read {str(path)!r}: {exc}") from None
    artifacts = best.get("artifacts") if isinstance(best, dict) else None
    if (not isinstance(artifacts, dict) or not artifacts) and required:
        raise ConfigError(f"{str(path)!r} lists no artifacts: run the tuning with export formats to write them.")
    batch_size = (best.get("best") or {}).get("batch_size") or (best.get("config") or {}).get("batch_size")
    return artifacts if isinstance(artifacts, dict) else {}, batch_size


def _inside(out_dir: Path, name: Any, fmt: str) -> Path:
    """``out_dir / name``, refused when ``name`` would leave ``out_dir`` (absolute, ``..``, links)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"The {fmt} artifact's entry in best_config.json names no file: export it again.")
    path = out_dir / name
    if Path(name).is_absolute() or not path.resolve().is_relative_to(out_dir.resolve()):
        raise ConfigError(
            f"The {fmt} artifact's path {name!r} leaves {str(out_dir)!r}; artifacts must be files inside the "
            "run's directory. Fix best_config.json or export again."
        )
    return path


def _modified(path: Path, record: dict[str, Any]) -> list[Path]:
    """The artifact's files whose sha256 differs from the one recorded at export: the file, and
    for OpenVINO its weights file (``bin_path``) too."""
    changed = []
    if record.get("sha256") and file_digest(path) != record["sha256"]:
        changed.append(path)
    weights = record.get("bin_path")
    if weights:
        bin_file = _inside(path.parent, weights, "openvino")
        if not bin_file.is_file() or (record.get("bin_sha256") and file_digest(bin_file) != record["bin_sha256"]):
            changed.append(bin_file)
    return changed


def _check_files(path: Path, record: dict[str, Any], fmt: str, allow_modified: bool) -> None:
    """Refuse (or, with ``allow_modified``, warn about) an artifact whose files are missing or
    are not the ones exported and checked."""
    if not path.is_file():
        raise ConfigError(f"The {fmt} artifact's file {str(path)!r} is missing: export it again.")
    changed = _modified(path, record)
    if changed:
        names = " and ".join(repr(str(p)) for p in changed)
        if not allow_modified:
            raise ConfigError(
                f"{names} is not the file that was exported and checked (missing, or its sha256 differs). Export "
                "again, or pass allow_modified=True to load it anyway."
            )
        warnings.warn(f"Loading {names} although it changed since export.", stacklevel=4)


def _is_winner(record: dict[str, Any]) -> bool:
    """Whether an artifact is the measured winner: marked so, and not TorchScript's fallback form
    (the float model written when the tuned one cannot be traced), which an export before that
    form was labelled may have marked the winner all the same."""
    return bool(record.get("winner")) and record.get("form") != "fallback"


def _not_the_winner(record: dict[str, Any]) -> str:
    """What :attr:`Predictor.chosen` adds for an artifact that is another model than the winner."""
    if _is_winner(record) or ("winner" not in record and record.get("form") != "fallback"):
        return ""  # the winner, or an export that recorded neither
    note = record.get("form_note") or record.get("reason") or "another form of the model"
    return f"; NOT the measured winner, its speed is its own ({note})"
