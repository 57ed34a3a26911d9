"""What :func:`autotune.load` serves: every candidate timed here on the same batches, the fastest
taken, and compared with the untuned model (or, without it, the run's recorded baseline).

The candidates are the exported artifacts that passed their checks and, when the original model is
given, the tuned torch pipeline itself (:class:`TorchPredictor`, built by
:func:`autotune.predictor`): a float32 export of a bfloat16 or compiled winner can be slower than
the untuned model, while the pipeline the search measured is not.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from autotune.deploy.load import (
    Predictor,
    _choose,
    _is_winner,
    _load_one,
    _not_the_winner,
    _read_artifacts,
    _read_parity,
    run_device,
)
from autotune.errors import ConfigError
from autotune.runtimes.base import formats

__all__ = ["TorchPredictor", "decide", "load", "rate", "serve", "timing_batch", "torch_candidate"]


def load(
    out_dir: str | Path,
    *,
    model: Any = None,
    dataset: Any = None,
    collate_fn: Any = None,
    format: str | None = None,
    device: str | None = None,
    allow_modified: bool = False,
) -> Predictor:
    """Serve a tuning run from ``out_dir``: the fastest here of what it may serve, named truthfully.

    The candidates are the exported artifacts that passed their checks and, with ``model``, the
    tuned torch pipeline (:func:`autotune.predictor`: the model the search measured). Each is timed
    briefly here on the same batches of the run's validation samples, and the fastest is served.
    With ``model`` the untuned model is timed the same way, and a served candidate slower than it
    is said in :attr:`Predictor.chosen` and warned about; without it the comparison is with the
    run's recorded baseline, an end-to-end figure from the run's machine, and ``chosen`` says so.

    Args:
        out_dir: The run's directory, holding ``best_config.json`` and the artifact files.
        model: The original model, as given to :func:`autotune.optimize` (a module or a factory):
            adds the tuned torch pipeline to the candidates and the untuned model as the reference.
        dataset: The data the build needs (configs that prune or quantize), as for :func:`autotune.apply`.
        collate_fn: The run's own collate, when it had one: batches the timing samples.
        format: ``"onnx"``, ``"torchscript"`` or ``"torch"`` (needs ``model``) serves that one,
            untimed. An artifact that failed its checks loads only when named here, with a warning.
        device: ``"cpu"`` or ``"cuda[:N]"``: ONNX runs on the matching ONNX Runtime provider
            where a session gets it here (else on its CPU provider, with a warning). Default: the
            device the run was tuned on (``best_config.json``), or the CPU, with a warning, where
            this machine lacks it.
        allow_modified: Load an artifact whose sha256 differs from the one recorded at export
            (refused by default: the file is not the one that was checked).

    Returns:
        A :class:`Predictor` (:class:`~autotune.deploy.serve.TorchPredictor` for ``"torch"``):
        ``pred(batch)``, ``pred.predict(samples)``, ``pred.chosen``, ``pred.format``.

    Raises:
        ConfigError: no such directory, no ``best_config.json``, no artifacts (without ``model``),
            an unknown format, nothing that passed its checks, the artifact's file is missing,
            lies outside ``out_dir`` or changed since export.
    """
    out_dir = Path(out_dir)
    device = run_device(out_dir) if device is None else device
    try:
        torch.device(device)
    except RuntimeError:
        raise ConfigError(f"`device` must be 'cpu' or 'cuda[:N]', but got {device!r}.") from None
    artifacts, run_batch_size = _read_artifacts(out_dir, required=model is None and format != "torch")
    if format == "torch":
        if model is None:
            raise ConfigError("format='torch' serves the tuned torch pipeline: pass the original model, model=...")
        served = torch_candidate(out_dir, model, dataset, collate_fn, device, None)
        served.chosen = "torch: asked for (the tuned pipeline, the model the search measured)"
        return served
    if format is not None:
        fmt, record = _choose(artifacts, format, out_dir)
        predictor = _load_one(out_dir, fmt, record, run_batch_size, device, allow_modified)
        predictor.chosen += _not_the_winner(record)
        return predictor
    passed = [f for f in formats() if (artifacts.get(f) or {}).get("status") == "ok"]
    if not passed and model is None:
        _choose(artifacts, None, out_dir)  # raises: nothing passed its checks
    loaded = {f: _load_one(out_dir, f, artifacts[f], run_batch_size, device, allow_modified) for f in passed}
    return serve(out_dir, loaded, model, dataset, collate_fn, device)


class _Flat(torch.nn.Module):
    """A torch model called as an artifact is: its inputs flat by position, the keyword ones after
    the positional ones; a ``ModelOutput`` comes back as a dict, its type noted in ``record``."""

    def __init__(self, model: Any, input_names: list[str], record: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.n_args = sum(1 for n in input_names if n.startswith("input_") and n[6:].isdigit())
        self.keys = input_names[self.n_args :]
        self.record = record

    def forward(self, *flat: torch.Tensor) -> Any:
        from collections.abc import Mapping

        from autotune.export.stored import output_type

        out = self.model(*flat[: self.n_args], **dict(zip(self.keys, flat[self.n_args :], strict=True)))
        if isinstance(out, Mapping) and type(out) is not dict:
            self.record.setdefault("output_type", output_type(out))
            out = dict(out)
        return out


class TorchPredictor(Predictor):
    """A torch model (the tuned pipeline, or the untuned one it is compared with) behind the same
    interface as an artifact's :class:`~autotune.deploy.load.Predictor`: ``__call__`` on batches,
    ``predict`` on samples, ``chosen`` and ``format`` (``"torch"``)."""

    def __init__(
        self, model: Any, input_names: list[str], out_dir: Path, batch_size: int, device: str, run: dict[str, Any]
    ) -> None:
        record: dict[str, Any] = {"input_names": list(input_names), "output_names": []}
        super().__init__(_Flat(model, list(input_names), record), "torch", out_dir, record, batch_size, device)
        self.model = model
        self.run = run

    def __repr__(self) -> str:
        return f"TorchPredictor(batch_size={self.batch_size}, device={str(self.device)!r})"


def timing_batch(parity: dict[str, Any], batch_size: int, collate_fn: Any = None) -> dict[str, torch.Tensor]:
    """One batch of the run's validation samples, by input name, as the winner batches them (the
    stored batches of a run with token sequences or its own collate), else ``batch_size`` samples
    collated with ``collate_fn`` (default: torch's)."""
    from torch.utils.data import default_collate

    from autotune.export.parity import flat_inputs

    stored = [b["batch"] for b in parity.get("batches") or []]
    if stored:
        names, tensors, _ = flat_inputs(max(stored, key=lambda b: int(flat_inputs(b)[1][0].shape[0])))
    else:
        samples = parity["samples"]
        part = [samples[i % len(samples)] for i in range(batch_size)]
        names, tensors, _ = flat_inputs((collate_fn or default_collate)(part))
    return dict(zip(names, tensors, strict=True))


def rate(predict: Predictor, batch: dict[str, torch.Tensor]) -> float:
    """Samples/s of ``predict`` on ``batch``: the median of a few calls after a warm-up."""
    for _ in range(2):
        predict(batch)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        predict(batch)
        times.append(time.perf_counter() - start)
    n = int(next(iter(batch.values())).shape[0])
    return n / max(statistics.median(times), 1e-9)


def decide(rates: dict[str, float], untuned: float | None, recorded: float | None) -> tuple[str, str, str | None]:
    """The candidate to serve and what to say about it.

    Args:
        rates: Samples/s here of each candidate that may be served (``"torch"`` the tuned pipeline).
        untuned: Samples/s here of the untuned model on the same batches, when it was given.
        recorded: The run's baseline samples/s (end to end, on the run's machine), used when
            ``untuned`` is not known.

    Returns:
        ``(format, chosen, slower)``: ``slower`` is a one-line warning when the served candidate is
        slower than the untuned model (or than the run's recorded baseline), else ``None``.
    """
    pick = max(rates, key=lambda k: rates[k])
    timing = ", ".join(f"{_name(k)} {r:,.0f}/s" for k, r in sorted(rates.items(), key=lambda kv: -kv[1]))
    chosen = f"{pick}: the fastest here ({timing}"
    if untuned is not None:
        ratio = rates[pick] / max(untuned, 1e-9)
        chosen += f"; the untuned model {untuned:,.0f}/s on the same batches: {ratio:.2f}x)"
        if ratio >= 1:
            return pick, chosen, None
        slower = (
            f"load() serves {pick}, SLOWER than the untuned model here ({ratio:.2f}x): none of the candidates beat it"
        )
        return pick, f"{chosen}; {slower}", slower
    chosen += ")"
    if recorded is None:
        return pick, chosen + "; not compared with the untuned model: pass model= to load() to time it here", None
    chosen += (
        f"; the run's baseline was {recorded:,.0f}/s, its end-to-end figure (loader included, on the run's "
        "machine), not a like-for-like comparison: pass model= to load() to time the untuned model here"
    )
    if rates[pick] >= recorded:
        return pick, chosen, None
    slower = (
        f"load() serves {pick} at {rates[pick]:,.0f}/s here, below the run's baseline of {recorded:,.0f}/s: "
        "pass model= to load() to compare with the untuned model and serve the tuned pipeline"
    )
    return pick, f"{chosen}; {slower}", slower


def _name(fmt: str) -> str:
    return "torch (the tuned pipeline)" if fmt == "torch" else fmt


def _run_record(out_dir: Path) -> dict[str, Any]:
    """``best_config.json`` as a dict, or ``{}`` when it cannot be read."""
    try:
        best = json.loads((out_dir / "best_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return best if isinstance(best, dict) else {}


def serve(
    out_dir: Path, loaded: dict[str, Predictor], model: Any, dataset: Any, collate_fn: Any, device: str
) -> Predictor:
    """The fastest here of ``loaded`` (and, with ``model``, the tuned torch pipeline), compared
    with the untuned model or the run's recorded baseline, saying which and why."""
    best = _run_record(out_dir)
    batch_size = max(
        [p.batch_size for p in loaded.values()] or [int((best.get("config") or {}).get("batch_size") or 1)]
    )
    try:
        batch = timing_batch(_read_parity(out_dir), batch_size, collate_fn)
    except Exception as exc:  # nothing to time on: the measured model where it is known
        batch, error = None, exc
    if model is not None:
        loaded["torch"] = torch_candidate(out_dir, model, dataset, collate_fn, device, batch)
    if batch is None:
        return _untimed(loaded, error)
    rates = {f: rate(p, batch) for f, p in loaded.items()}
    untuned = None if model is None else _untuned_rate(model, out_dir, device, batch, loaded["torch"].batch_size)
    recorded = (best.get("baseline") or {}).get("samples_per_s")
    pick, chosen, slower = decide(rates, untuned, recorded if isinstance(recorded, (int, float)) else None)
    served = loaded[pick]
    served.chosen = chosen + _not_the_winner(served.record)
    if slower:
        warnings.warn(slower, stacklevel=3)
    return served


def _untimed(loaded: dict[str, Predictor], error: Exception) -> Predictor:
    """What to serve when nothing can be timed: the tuned pipeline, else the artifact recorded as
    the winner's own form, else the first that passed; never a float export under the winner's name."""
    pick = loaded.get("torch") or next((p for p in loaded.values() if _is_winner(p.record)), None)
    if pick is not None and pick.format == "torch":
        why = "the tuned pipeline, the model the search measured"
    elif pick is not None:
        why = "the winner's own form, as its record says"
    else:
        pick, why = next(iter(loaded.values())), "the first that passed its checks"
    pick.chosen = f"{pick.format}: {why} (could not time the candidates here: {error}){_not_the_winner(pick.record)}"
    return pick


def torch_candidate(
    out_dir: Path, model: Any, dataset: Any, collate_fn: Any, device: str, batch: dict[str, torch.Tensor] | None
) -> Predictor:
    """The tuned torch pipeline of the run, built once, behind the :class:`Predictor` interface."""
    from autotune.run.predict import predictor

    built = predictor(model, out_dir, dataset=dataset, collate_fn=collate_fn, device=device)
    best = _run_record(out_dir)
    names = (
        list(batch)
        if batch is not None
        else list(next(iter((best.get("artifacts") or {}).values()), {}).get("input_names", ["input_0"]))
    )
    run = {"config": best.get("config") or {}, "data": best.get("data") or {}}
    return TorchPredictor(built.model, names, out_dir, int(built.config.batch_size), built.device, run)


def _untuned_rate(model: Any, out_dir: Path, device: str, batch: dict[str, torch.Tensor], batch_size: int) -> float:
    """Samples/s here of the untuned model, timed as the candidates are, on the same batches."""
    import copy

    module = model if isinstance(model, torch.nn.Module) else model()
    on = next((p.device for p in module.parameters()), torch.device(device))
    if on != torch.device(device):  # the caller's model stays where it is
        module = copy.deepcopy(module).to(device)
    training = module.training
    module.eval()
    try:
        return rate(TorchPredictor(module, list(batch), out_dir, batch_size, device, {}), batch)
    finally:
        module.train(training)
