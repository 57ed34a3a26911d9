"""What runs inside a trial worker: set up once, then build, measure and guard configurations.

The parent (:mod:`autotune.runner`) starts ``python -m autotune._worker READ_FD WRITE_FD``
and talks to it over two pipes with pickled messages::

    parent -> ("init", spec)            worker -> ("ready", info) | ("fail", kind, message)
    parent -> ("trial", config_dict)    worker -> ("result", result_dict)
    parent -> ("call", name, *args)     worker -> ("result", dict)   (name: rounds, held_out, export, diagnose)
    parent -> ("stop",)

The same :class:`TrialContext` also runs in-process when ``isolation="inprocess"``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ._fidelity import attention_mask
from .build import BuildExtras, BuildState, TunedModule, build
from .config import Config
from .data import to_device
from .errors import InputError, TrialError
from .guard import Reference, check_finite, collect_outputs, evaluate, make_reference
from .measure import MeasureSettings, call_model, measure, memory_mark, noise_reason, size_bytes

__all__ = ["TrialContext", "WorkerSpec", "classify"]


@dataclasses.dataclass
class WorkerSpec:
    """Everything a worker needs, sent once when it starts.

    Attributes:
        model: An ``nn.Module`` or a zero-argument factory returning one.
        dataset: The map-style dataset.
        metric: ``metric(outputs, batch) -> float`` or ``None`` for fidelity.
        device: Concrete device string.
        baseline: The baseline configuration (dict).
        val_indices: Indices of the fixed validation samples.
        measure: Timing settings.
        seed: Seeds torch before the factory runs and before each trial.
        loss_fn: ``loss_fn(outputs, batch) -> Tensor`` for recovery fine-tuning, or ``None``.
        train_dataset: Fine-tuning samples (default: ``dataset``).
        prune_ignore: Module names pruning keeps whole.
        n_calibration: Batches (of the baseline batch size) for static quantization.
        test_dataset: Held-out samples, scored only after the search.
        max_metric_drop: The guard's tolerance, also applied to exported artifacts.
        mode: ``"inference"`` or ``"train"``.
        optimizer: Training mode: an optimizer class, ``(class, kwargs)`` or factory.
        effective_batch_size: Training mode: samples per optimizer step (``None``: the trial's
            batch size, no accumulation).
        n_train_steps: Training mode: optimizer steps of the loss-curve guard (at the baseline's
            effective batch size; the same number of samples for every trial).
        loss_tolerance: Training mode: largest relative change of the final mean loss.
        output_kind: How fidelity judges each output (see :func:`autotune._fidelity.infer_kinds`).
    """

    model: Any
    dataset: Any
    metric: Callable[[Any, Any], float] | None
    device: str
    baseline: dict[str, Any]
    val_indices: list[int]
    measure: MeasureSettings
    seed: int = 0
    loss_fn: Callable[[Any, Any], Any] | None = None
    train_dataset: Any = None
    prune_ignore: tuple[str, ...] = ()
    n_calibration: int = 8
    test_dataset: Any = None
    max_metric_drop: float = 0.01
    mode: str = "inference"
    optimizer: Any = None
    effective_batch_size: int | None = None
    n_train_steps: int = 20
    loss_tolerance: float = 0.05
    output_kind: Any = "auto"


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 400:
        text = text[:400] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _from_compiler(exc: BaseException) -> bool:
    if type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return any("/torch/_dynamo/" in f.filename or "/torch/_inductor/" in f.filename for f in frames)


def classify(exc: BaseException) -> tuple[str, str, str]:
    """(status, kind, reason) of a trial that raised ``exc``."""
    if isinstance(exc, TrialError):
        # A method that cannot apply to this model (nothing to quantize, say) rules the
        # candidate out like a guard failure; it says nothing about the rest of the space.
        status = "infeasible" if exc.kind in ("nan", "unsupported") else "error"
        return status, exc.kind, str(exc)
    if _is_oom(exc):
        return "oom", "oom", _one_line(exc)
    if _from_compiler(exc):
        return "error", "compile", _one_line(exc)
    return "error", "runtime", _one_line(exc)


def record_fault(result: dict[str, Any], exc: BaseException, device: str) -> None:
    """Record a trial's fault in its result (status, kind, reason); free cached CUDA memory."""
    status, kind, reason = classify(exc)
    result.update(status=status, kind=kind, reason=reason)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def instantiate_model(spec: WorkerSpec) -> torch.nn.Module:
    """The spec's model: the module itself, or what its factory returns."""
    model = spec.model
    if not isinstance(model, torch.nn.Module):
        try:
            model = model()
        except Exception as exc:
            raise InputError(f"The model factory raised {_one_line(exc)}") from exc
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"The model factory must return a torch.nn.Module, but returned {type(model).__name__}.")
    return model


def make_context(spec: WorkerSpec) -> Any:
    """The worker state for the spec's mode: :class:`TrialContext` or, in training mode,
    :class:`autotune._train_trial.TrainContext`."""
    if spec.mode == "train":
        from ._train_trial import TrainContext

        return TrainContext(spec)
    return TrialContext(spec)


class TrialContext:
    """A worker's state: the model, the data, the baseline's reference outputs."""

    def __init__(self, spec: WorkerSpec) -> None:
        from ._pristine import snapshot

        # Stock PyTorch as the worker found it: restored before every build and measurement.
        self.pristine = snapshot()
        self.spec = spec
        torch.manual_seed(spec.seed)
        self.model = instantiate_model(spec).eval()
        self.samples = [spec.dataset[i] for i in spec.val_indices]
        self.extras = self._extras()
        baseline = self.build(spec.baseline)
        self._probe(baseline)
        self.reference: Reference = make_reference(baseline, self.samples, spec.metric, spec.output_kind, spec.loss_fn)
        self.info = {
            "n_params": sum(p.numel() for p in self.model.parameters()),
            "baseline_metric": self.reference.metric,
            "n_val": len(self.samples),
        }

    def _extras(self) -> BuildExtras:
        """Example and calibration batches, drawn once, outside the validation subset if possible."""
        import numpy as np
        from torch.utils.data import default_collate

        spec = self.spec
        size = spec.baseline["batch_size"]
        held = set(spec.val_indices)
        pool = [i for i in range(len(spec.dataset)) if i not in held] or list(range(len(spec.dataset)))
        picked = np.random.default_rng(spec.seed + 1).permutation(pool)[: size * spec.n_calibration].tolist()
        calibration = [
            default_collate([spec.dataset[i] for i in picked[k : k + size]]) for k in range(0, len(picked), size)
        ]
        return BuildExtras(
            # At least two samples: an export traced at batch 1 would specialise the batch size.
            example=default_collate(self.samples[: max(2, min(8, len(self.samples)))]),
            calibration=calibration,
            loss_fn=spec.loss_fn,
            train_dataset=finetune_dataset(spec),
            batch_size=size,
            prune_ignore=tuple(spec.prune_ignore),
            seed=spec.seed,
        )

    def fresh_model(self) -> torch.nn.Module:
        """An untouched copy of the model for one build: a deep copy, or the factory's output
        when the model cannot be copied (it holds a lock or an open file, say)."""
        import copy

        try:
            return copy.deepcopy(self.model)
        except Exception as exc:
            if isinstance(self.spec.model, torch.nn.Module):
                raise InputError(
                    f"The model cannot be copied for each trial ({_one_line(exc)}). Pass a zero-argument "
                    "function that builds it instead."
                ) from exc
            torch.manual_seed(self.spec.seed)
            return self.spec.model().eval()

    def _probe(self, state: BuildState) -> None:
        from torch.utils.data import default_collate

        from .data import has_tensor

        batch = default_collate(self.samples[:2])
        try:
            with torch.inference_mode():
                out = call_model(state.model, to_device(batch, torch.device(state.device)))
        except Exception as exc:
            raise InputError(f"The model's forward pass failed on the first batch: {_one_line(exc)}") from exc
        if not has_tensor(out):
            raise InputError(
                f"The model's forward pass returned {_describe_output(out)}, with no tensor in it: there is nothing "
                "to compare or time. Return the model's outputs (a tensor, or a tuple, dict or dataclass of tensors)."
            )

    def build(self, config: dict[str, Any]) -> BuildState:
        from ._pristine import restore

        restore(self.pristine)
        if config.get("compile_mode", "none") != "none":
            # Compiled trials share the wrapper's code object; a fresh cache keeps the
            # recompilation limit from silently falling back to eager after a few trials.
            torch._dynamo.reset()
        return build(self.fresh_model(), Config(config), self.spec.device, extras=self.extras, copy_model=False)

    def run_trial(self, config: dict[str, Any]) -> dict[str, Any]:
        """Build, guard and measure one configuration; never raises."""
        started = time.perf_counter()
        result: dict[str, Any] = {"status": "ok", "kind": None, "reason": None}
        try:
            torch.manual_seed(self.spec.seed)
            mark = memory_mark(self.spec.device)  # before the build: the trial's memory is its own
            state = self.build(config)
            # Timing first: compilation lands in its warm-up (compile_s), and the numbers of a
            # candidate the guard rejects are still recorded.
            result.update(state.info)
            result.update(self._measure_clean(state, mark))
            result["size_bytes"], result["size_bytes_compressed"] = size_bytes(state.model)
            guard_start = time.perf_counter()
            outputs = collect_outputs(state, self.samples)
            check_finite(outputs)
            value = evaluate(
                outputs,
                self.samples,
                self.reference.chunk,
                self.spec.device,
                self.spec.metric,
                self.reference.outputs,
                self.reference.kinds,
                self.reference.mask,
            )
            result["guard_s"] = time.perf_counter() - guard_start
            result["metric"] = value
            result["metric_drop"] = self.reference.metric - value
        except Exception as exc:
            record_fault(result, exc, self.spec.device)
        result["trial_s"] = time.perf_counter() - started
        return result

    def _measure_clean(self, state: BuildState, mark: float) -> dict[str, Any]:
        """Measure ``state``; measure again (a bounded number of times) while the windows disagree
        or other processes used the CPU, keep the cleanest, and mark it ``noisy`` if none was clean."""
        from ._pristine import restore

        settings = self.spec.measure
        best: dict[str, Any] | None = None
        for attempt in range(1 + settings.n_remeasure):
            restore(self.pristine)
            result = measure(state, self.spec.dataset, settings, mem_mark=mark if attempt == 0 else None)
            result["noise"] = noise_reason(result, settings)
            if best is None or _noise_rank(result) < _noise_rank(best):
                best = {**result, "compile_s": best["compile_s"] if best else result["compile_s"]}
                best["peak_mem_mib"] = max(best["peak_mem_mib"], result["peak_mem_mib"])
            if result["noise"] is None:
                break
        assert best is not None
        best["n_measurements"] = attempt + 1
        best["noisy"] = best["noise"] is not None
        return best

    def rounds(
        self,
        configs: list[dict[str, Any]],
        n_min: int,
        n_max: int,
        target: float | None = None,
        max_s: float | None = None,
        diagnose: bool = False,
    ) -> dict[str, Any]:
        """Measure ``configs`` in interleaved rounds whose order alternates (A, B, C / C, B, A).

        After ``n_min`` rounds they stop once ``max_s`` seconds have passed or, with ``target``
        and two configurations, once the 95% interval of ``configs[1]``'s ratio to ``configs[0]``
        is within +-``target``; never after more than ``n_max`` rounds. With ``diagnose``, each round also
        times every configuration's loader alone and model alone (:mod:`autotune._diagnose`), so
        the diagnosis comes from the same rounds as the end-to-end figures.

        Returns:
            ``{"rounds": [[{"samples_per_s", "latency_ms_p50", "latency_ms_p95", "cov",
            "others_cpu", "peak_mem_mib", ...}, ...per config], ...per round]}``.
        """
        from ._claim import enough_rounds
        from ._pristine import restore

        # Builds are lazy (compilation happens in the first measurement), so building them all
        # first, each after a dynamo reset, is safe.
        states = [self.build(c) for c in configs]
        started = time.perf_counter()
        rounds: list[list[dict[str, Any]]] = []
        keys = ("samples_per_s", "latency_ms_p50", "latency_ms_p95", "cov", "others_cpu", "peak_mem_mib")
        for r in range(n_max):
            row: list[dict[str, Any]] = [{} for _ in states]
            order = range(len(states)) if r % 2 == 0 else reversed(range(len(states)))
            for i in order:
                restore(self.pristine)
                m = measure(states[i], self.spec.dataset, self.spec.measure)
                row[i] = {k: m[k] for k in keys}
                if diagnose:
                    restore(self.pristine)
                    row[i].update(_halves(states[i], self.spec.dataset, self.spec.measure))
            rounds.append(row)
            if enough_rounds(rounds, n_min, target, max_s, time.perf_counter() - started):
                break
        return {"rounds": rounds}

    def export(self, config: dict[str, Any], out_dir: str, formats: list[str]) -> dict[str, Any]:
        """Write the winner's artifacts into ``out_dir`` with their parity against the tuned model."""
        import dataclasses as dc
        from pathlib import Path

        from .export import export_artifacts, ship_measured

        if config.get("compile_mode", "none") != "none":
            torch._dynamo.reset()
        extras = dc.replace(self.extras, keep_float=True)
        state = build(self.fresh_model(), Config(config), self.spec.device, extras=extras, copy_model=False)
        # A TorchScript or ONNX Runtime winner is exported from the torch model it was made from.
        tuned = state.torch_model if state.torch_model is not None else state.model
        common = {
            "fallback": state.float_model,
            "metric": self.spec.metric,
            "baseline_metric": self.reference.metric,
            "max_metric_drop": self.spec.max_metric_drop,
            "baseline_outputs": self.reference.outputs,
            "kinds": self.reference.kinds,
            "mask": self.reference.mask,
            "metric_chunk": self.reference.chunk,
        }
        size, out = state.batch_size, Path(out_dir)
        by_format = {}
        artifacts: dict[str, Any] = {}
        measured = state.artifact if state.artifact and state.artifact["format"] in formats else None
        if measured is not None:
            # The winner ran an exported file: that file ships, not a re-export of its torch model.
            artifacts = ship_measured(measured, state.model, self.samples, size, out, **_check_args(common))
            by_format[measured["format"]] = collect_outputs(state, self.samples)
        rest = [f for f in formats if f != "onnx" and f not in artifacts]
        artifacts.update(export_artifacts(tuned, extras.example, self.samples, size, out, rest, **common))
        if "onnx" in formats and "onnx" not in artifacts:
            model, note = _onnx_form(tuned, state.device)
            onnx = export_artifacts(model, extras.example, self.samples, size, out, ["onnx"], **common)
            if onnx["onnx"]["status"] == "failed" and state.quantization != "none" and state.float_model is not None:
                # No ONNX exporter takes torch's int8 modules: the pruned float model, quantized
                # by ONNX Runtime with the same method, is the nearest form of the winner.
                source = (
                    TunedModule(state.float_model, None, state.channels_last),
                    state.quantization,
                    extras.calibration,
                )
                first = onnx["onnx"].get("error")
                onnx = export_artifacts(
                    model, extras.example, self.samples, size, out, ["onnx"], onnx_source=source, **common
                )
                note = (
                    f"exported from the pruned float model and quantized by onnxruntime ({state.quantization}): {first}"
                )
            if note:
                onnx["onnx"]["form_note"] = note
                keep = state.model
                state.model = model
                by_format["onnx"] = collect_outputs(state, self.samples)
                state.model = keep
            artifacts.update(onnx)
        for fmt, record in artifacts.items():
            _label(record, fmt, state, measured)
        # What `autotune verify` re-checks the artifacts against, on any machine: the validation
        # samples and the outputs of the form each artifact was exported from.
        state.model = tuned
        outputs = collect_outputs(state, self.samples)
        parity = {
            "samples": _plain(self.samples),
            "outputs": outputs,
            "outputs_by_format": by_format,
            "baseline_outputs": self.reference.outputs,
            "kinds": self.reference.kinds,
            "max_metric_drop": self.spec.max_metric_drop,
        }
        torch.save(parity, out / "parity.pt")
        return {"artifacts": artifacts}

    def held_out(self, baseline: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
        """The metric of the baseline and the winner on the held-out test samples."""
        samples = [self.spec.test_dataset[i] for i in range(len(self.spec.test_dataset))]
        outputs = [collect_outputs(self.build(c), samples) for c in (baseline, best)]
        chunk, device, metric = self.reference.chunk, self.spec.device, self.spec.metric
        judge = (self.reference.kinds, attention_mask(samples))
        base = evaluate(outputs[0], samples, chunk, device, metric, outputs[0], *judge)
        value = evaluate(outputs[1], samples, chunk, device, metric, outputs[0], *judge)
        return {"n_samples": len(samples), "baseline": base, "best": value, "drop": base - value}

    def diagnose(self, config: dict[str, Any]) -> dict[str, Any]:
        """Samples/s of ``config``'s loader alone and of its model alone (:mod:`autotune._diagnose`)."""
        from ._diagnose import diagnose_state

        torch.manual_seed(self.spec.seed)
        return diagnose_state(self.build(config), self.spec.dataset, self.spec.measure)


def _noise_rank(result: dict[str, Any]) -> tuple[bool, float]:
    """Clean before noisy, then the steadier windows first."""
    return (result["noise"] is not None, result["cov"] + result["others_cpu"])


def _halves(state: BuildState, dataset: Any, settings: MeasureSettings) -> dict[str, float]:
    """The loader alone and the model alone of ``state``, timed for one short window each."""
    from ._diagnose import diagnose_state

    d = diagnose_state(state, dataset, settings)
    return {k: d[k] for k in ("loader_samples_per_s", "model_samples_per_s")}


def _describe_output(out: Any) -> str:
    if out is None:
        return "None"
    return f"a {type(out).__name__}"


def finetune_dataset(spec: WorkerSpec) -> Any:
    """What recovery fine-tuning trains on: ``train_dataset``, else the dataset's samples outside
    the validation subset, so nothing trains on what the guard scores."""
    if spec.train_dataset is not None:
        return spec.train_dataset
    from torch.utils.data import Subset

    held = set(spec.val_indices)
    return Subset(spec.dataset, [i for i in range(len(spec.dataset)) if i not in held])


def _check_args(common: dict[str, Any]) -> dict[str, Any]:
    """The parity-check arguments among :func:`~autotune.export.export_artifacts`' keywords."""
    return {k: v for k, v in common.items() if k != "fallback"}


def _label(record: dict[str, Any], fmt: str, state: BuildState, measured: dict[str, Any] | None) -> None:
    """Say whether an artifact is the measured winner; one that is not is another model, and its
    speed is its own (``autotune verify`` times it), never the winner's speedup."""
    if record.get("winner"):
        return
    why = record.get("form_note")
    if why is None and measured is not None:
        why = f"the winner runs {measured['format']} ({state.runtime}); this is exported from its torch model"
    if why is None and state.runtime != "torch":
        why = f"the winner runs {state.runtime}; this is exported from its torch model"
    if why is None and state.compile_mode != "none":
        why = (
            f"the winner runs torch.compile (mode {state.compile_mode}), which no file format carries; "
            "this is its uncompiled module"
        )
    record["winner"] = why is None
    if why is not None:
        record["form_note"] = why


def _plain(obj: Any) -> Any:
    """``obj`` with numpy arrays and scalars as tensors and numbers, so that ``parity.pt`` loads
    with ``weights_only=True`` and no other globals allowed."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _onnx_form(tuned: Any, device: str) -> tuple[Any, str | None]:
    """The form of the tuned model to export to ONNX: itself, except that autocast on the CPU is
    dropped (the exporter would write a bfloat16 graph ONNX Runtime's CPU provider cannot run).
    Parity is then measured against that float32 form, and the metric against the baseline."""
    from .build import TunedModule
    from .export.parity import exportable

    inner = exportable(tuned)
    if not (device == "cpu" and isinstance(inner, TunedModule) and inner.amp_dtype is not None):
        return tuned, None
    note = f"exported in float32: {inner.amp_dtype} autocast dropped, ONNX Runtime's CPU provider has no such kernels"
    return TunedModule(inner.model, None, inner.channels_last), note


def serve(conn: Any) -> None:
    """The worker's loop over one connection."""
    import io
    import pickle

    message = conn.recv()
    try:
        spec = torch.load(io.BytesIO(message[1]), weights_only=False, pickle_module=pickle)
        ctx = make_context(spec)
    except InputError as exc:
        conn.send(("fail", "input", str(exc)))
        return
    except Exception as exc:
        conn.send(("fail", "error", f"{_one_line(exc)}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", ctx.info))
    while True:
        message = conn.recv()
        if message[0] == "trial":
            conn.send(("result", ctx.run_trial(message[1])))
        elif message[0] == "call" and message[1] in ("rounds", "held_out", "export", "diagnose"):
            try:
                conn.send(("result", getattr(ctx, message[1])(*message[2:])))
            except Exception as exc:
                conn.send(("result", {"error": _one_line(exc)}))
        else:
            return


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection

    read_fd, write_fd = int(argv[1]), int(argv[2])
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)

    class _Duplex:
        recv = inbox.recv
        send = outbox.send

    try:
        serve(_Duplex())
    except EOFError:  # the parent went away
        pass


if __name__ == "__main__":
    main(sys.argv)
