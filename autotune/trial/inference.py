"""A trial in inference mode: build a configuration, time it end to end, guard its outputs.

:class:`TrialContext` holds, for the whole study, the model, the validation samples and the
baseline's reference outputs; it also answers the calls made after the search: interleaved
rounds, the winner's export, the held-out score and the diagnosis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from autotune._pristine import restore
from autotune.batching import lengths_of
from autotune.compress.fallback import Int8Plan
from autotune.config import Config
from autotune.errors import AutotuneError, InputError
from autotune.knobs.state import BuildExtras, BuildState, TunedModule, wrap
from autotune.samples import call_model, to_device
from autotune.trial.build import build
from autotune.trial.context import Context
from autotune.trial.faults import one_line
from autotune.trial.fidelity import attention_mask
from autotune.trial.guard import (
    Reference,
    check_finite,
    collect_outputs,
    collect_per_sample,
    evaluate,
    make_reference,
    per_sample,
)
from autotune.trial.measure import (
    MeasureSettings,
    draw_seed,
    is_busy,
    measure,
    memory_mark,
    noise_reason,
    size_bytes,
)
from autotune.trial.spec import WorkerSpec

__all__ = ["TrialContext", "finetune_dataset"]

_COLLATE_HINT = (
    "check that the model runs on a batch of any few samples of the dataset, not only of the first ones "
    "(with a collate_fn: on every batch it makes of them)"
)


@contextlib.contextmanager
def _step(doing: str, hint: str) -> Iterator[None]:
    """Turn an unexpected failure while setting a worker up into an :class:`InputError` that says,
    in one line, what failed and what to change; autotune's own errors pass as they are."""
    try:
        yield
    except AutotuneError:
        raise
    except Exception as exc:
        raise InputError(f"{doing} failed: {one_line(exc)}. To fix it, {hint}.") from exc


_WARMUP_KEYS = ("compile_s", "compile_cache_hits", "compile_cache_misses")
# With what each round's windows compiled, or ran eager past dynamo's limit: a round's figure
# must time the pipeline a user runs, not a compile.
_ROUND_KEYS = ("samples_per_s", "latency_ms_p50", "latency_ms_p95", "cov", "others_cpu", "peak_mem_mib", "recompiles",
               "compile_fallbacks")  # fmt: skip


def _onnx_source(state: Any) -> tuple[Any, ...]:
    """How the ONNX artifact of a torch int8 winner is made: its pruned float model quantized by
    ONNX Runtime with the same method and weight scales, and, where the winner kept layers float,
    the fewest float on the graph that keep the guard (ranked as ``int8_fallback`` ranks them)."""
    config, extras = state.config or {}, state.extras
    how = {
        "per_channel": bool(config.get("int8_per_channel", False)),
        "keep": "auto" if state.info.get("int8_kept") else 0,
        "plan": extras.int8,
        "config": dict(config),
    }
    return wrap(state, state.float_model, autocast=False), state.quantization, extras.calibration, how


class TrialContext(Context):
    """A worker's state in inference mode: the model, the data, the baseline's reference outputs."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.model.eval()
        self._guard_s = 0.0  # the last guard's seconds: what a stopped trial saves of it
        with _step("Collating the example and calibration batches", _COLLATE_HINT):
            self.extras = self._extras()
        started = time.perf_counter()
        with _step("Building the baseline", "check that the model can be deep-copied and moved to the device"):
            baseline = self.build(spec.baseline)
        self._probe(baseline)
        with _step("Running the baseline on the validation samples", _COLLATE_HINT):
            self.reference: Reference = make_reference(
                baseline, self.samples, spec.metric, spec.output_kind, spec.loss_fn
            )
        # int8_fallback ranks layers by the guard's own judgement, at most about two trials' time.
        one_trial = time.perf_counter() - started + spec.measure.n_windows * spec.measure.window_s
        self.extras.int8 = Int8Plan(
            kinds=self.reference.kinds,
            max_drop=spec.max_metric_drop,
            metric=spec.metric,
            budget_s=max(10.0, 2 * one_trial),
            rankings=dict(spec.int8_rankings),
            store=spec.int8_store,
        )
        self.info = {
            "n_params": sum(p.numel() for p in self.model.parameters()),
            "baseline_metric": self.reference.metric,
            "n_val": len(self.samples),
        }

    def _extras(self) -> BuildExtras:
        """Example and calibration batches, drawn once, outside the validation subset if possible."""
        from autotune.samples import calibration_draw

        spec = self.spec
        collate = self.collate
        size = spec.baseline["batch_size"]
        # Never a sample the guard scores (see autotune.data.calibration_draw); apply() draws the
        # same, so the model it rebuilds is the one measured.
        n_train = len(spec.train_dataset) if spec.train_dataset is not None else None
        example, picked, from_train = calibration_draw(
            len(spec.dataset), len(spec.val_indices), spec.seed, size, spec.n_calibration, n_train
        )
        source = spec.train_dataset if from_train else spec.dataset
        calibration = [collate([source[i] for i in ids]) for ids in picked]
        return BuildExtras(
            # At least two samples: an export traced at batch 1 would specialise the batch size.
            example=collate([spec.dataset[i] for i in example]),
            calibration=calibration,
            loss_fn=spec.loss_fn,
            train_dataset=finetune_dataset(spec),
            batch_size=size,
            prune_ignore=tuple(spec.prune_ignore),
            seed=spec.seed,
            collate_fn=spec.collate_fn,
            lengths=_sort_keys(spec),
            images=spec.images,
        )

    def collate(self, samples: list[Any]) -> Any:
        """One batch of ``samples`` with the run's collate (as given: no trimming)."""
        from torch.utils.data import default_collate

        return (self.spec.collate_fn or default_collate)(samples)

    def _probe(self, state: BuildState) -> None:
        from autotune.samples import has_tensor

        try:
            batch = self.collate(self.samples[:2])
        except Exception as exc:
            raise InputError(f"collate_fn failed on the first two samples: {one_line(exc)}") from exc
        try:
            with torch.inference_mode():
                out = call_model(state.model, to_device(batch, torch.device(state.device)))
        except Exception as exc:
            raise InputError(f"The model's forward pass failed on the first batch: {one_line(exc)}") from exc
        if not has_tensor(out):
            raise InputError(
                f"The model's forward pass returned {_describe_output(out)}, with no tensor in it: there is nothing "
                "to compare or time. Return the model's outputs (a tensor, or a tuple, dict or dataclass of tensors)."
            )

    def build(self, config: dict[str, Any]) -> BuildState:
        """``config`` built on a fresh copy of the model, from stock process state."""
        self.reset(config)
        return build(self.fresh_model(), Config(config), self.spec.device, extras=self.extras, copy_model=False)

    def trial(self, config: dict[str, Any], result: dict[str, Any]) -> None:
        """Build, measure and guard one configuration."""
        torch.manual_seed(self.spec.seed)
        mark = memory_mark(self.spec.device)  # before the build: the trial's memory is its own
        state = self.build(config)
        # Timing first: compilation lands in its warm-up (compile_s), and the numbers of a
        # candidate the guard rejects are still recorded.
        result.update(state.info)
        result.update(self._measure_clean(state, mark, draw_seed(self.spec.seed, "trial", config)))
        if torch.device(self.spec.device).type == "cuda" and not result["stopped"]:
            # The model alone on batches already on the device, beside the end to end: whether
            # the pipeline feeds the chip (input-, launch- or compute-bound).
            from autotune.trial.diagnose import model_alone

            try:
                result.update(model_alone(state, self.spec.dataset, result["samples_per_s"], self.spec.measure))
            except Exception as exc:  # the end-to-end figure stands without its explanation
                result["bound_error"] = one_line(exc)
        result["size_bytes"], result["size_bytes_compressed"] = size_bytes(state.model, state.artifact)
        if result["stopped"]:
            # Far below the best so far after its first windows: neither more timing nor the
            # guard can make it a contender. What they would have cost is what was saved.
            result["fidelity_saved_s"] += self._guard_s
            result.update(
                status="stopped",
                kind="early-stop",
                reason=f"stopped after {result['n_windows']} of {self.spec.measure.n_windows} windows: "
                f"{result['samples_per_s']:,.0f} samples/s, under {self.spec.measure.stop_share:.0%} of the best so "
                f"far ({self.fidelity['best']:,.0f})",
            )
            return
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
            collate=self.extras.collate_fn,
            tokens=self.extras.token_outputs,
        )
        result["guard_s"] = self._guard_s = time.perf_counter() - guard_start
        result["metric"] = value
        result["metric_drop"] = self.reference.metric - value

    def _measure_clean(self, state: BuildState, mark: float, seed: int) -> dict[str, Any]:
        """Measure ``state``; measure again (a bounded number of times, each on its own draw of
        batches) while the windows disagree or other processes used the CPU, keep the cleanest,
        and mark it ``noisy`` if none was clean.

        With a ``share`` in :attr:`fidelity` (a screening trial) fewer windows are timed; with
        the ``best`` samples/s so far, running under ``stop_share`` of it ends the
        measurement (``stopped``) and nothing is measured again. ``fidelity_saved_s`` is the
        timing this saved, in seconds."""
        full = self.spec.measure
        settings = full
        if self.fidelity.get("share"):
            short = max(2, math.ceil(full.n_windows * self.fidelity["share"]))
            settings = dataclasses.replace(full, n_windows=min(short, full.n_windows))
        best = self.fidelity.get("best")
        stop_below = full.stop_share * best if best and full.stop_share > 0 else None
        best: dict[str, Any] | None = None
        for attempt in range(1 + settings.n_remeasure):
            restore(self.pristine)
            result = measure(
                state,
                self.spec.dataset,
                settings,
                mem_mark=mark if attempt == 0 else None,
                seed=seed + attempt,
                stop_below=stop_below if attempt == 0 else None,
            )
            # A window lasts about window_s, a little more: the windows not timed are what was saved.
            per_window = result["timed_s"] / max(1, result["n_windows"])
            result["fidelity_saved_s"] = (full.n_windows - result["n_windows"]) * per_window
            if result["stopped"]:
                result.update(noise=None, n_measurements=1, noisy=False, busy=is_busy(result, settings))
                return result
            result["noise"] = noise_reason(result, settings)
            if best is None or _noise_rank(result) < _noise_rank(best):
                # The build's warm-up (compile, cache reads) happened in the first measurement only.
                first = {k: best[k] for k in _WARMUP_KEYS} if best else {}
                best = {**result, **first}
                best["peak_mem_mib"] = max(best["peak_mem_mib"], result["peak_mem_mib"])
            if result["noise"] is None:
                break
        assert best is not None
        best["n_measurements"] = attempt + 1
        best["noisy"] = best["noise"] is not None
        best["busy"] = is_busy(best, settings)  # others' load, not merely windows that disagree
        return best

    def prepare(self, configs: list[dict[str, Any]]) -> list[BuildState]:
        # Builds are lazy (compilation happens in the first measurement), so building them all
        # first, each after a dynamo reset, is safe.
        return [self.build(c) for c in configs]

    def time_round(self, prepared: BuildState, diagnose: bool, seed: int = 0) -> dict[str, Any]:
        m = measure(prepared, self.spec.dataset, self.spec.measure, seed=seed)
        row = {k: m[k] for k in _ROUND_KEYS}
        if diagnose:
            restore(self.pristine)
            row.update(_halves(prepared, self.spec.dataset, self.spec.measure, seed))
        return row

    def _export_onnx(
        self, state: Any, tuned: Any, out: Any, common: dict[str, Any], by_format: dict[str, Any]
    ) -> dict[str, Any]:
        """The ONNX artifact of a winner that ran no ONNX file: its export, or the nearest form."""
        from autotune.export import export_artifacts

        size, example = state.batch_size, self.extras.example_on(state.device)
        model, note = _onnx_form(tuned, state.device)
        onnx = export_artifacts(model, example, self.samples, size, out, ["onnx"], **common)
        # ONNX Runtime has the same dynamic and static int8, not torchao's weight-only.
        ort_method = state.quantization in ("int8_dynamic", "int8_static")
        if onnx["onnx"]["status"] == "failed" and ort_method and state.float_model is not None:
            # No ONNX exporter takes torch's int8 modules: the pruned float model, quantized
            # by ONNX Runtime with the same method, is the nearest form of the winner.
            source = _onnx_source(state)
            first = onnx["onnx"].get("error")
            onnx = export_artifacts(model, example, self.samples, size, out, ["onnx"], onnx_source=source, **common)
            note = f"exported from the pruned float model and quantized by onnxruntime ({state.quantization}): {first}"
        if note:
            onnx["onnx"]["form_note"] = note
            keep = state.model
            state.model = model
            by_format["onnx"] = collect_outputs(state, self.samples)
            state.model = keep
        return onnx

    def _parity(self, state: Any, outputs: Any, by_format: dict[str, Any]) -> dict[str, Any]:
        """What ``autotune verify`` re-checks the artifacts against, as ``parity.pt`` stores it."""
        parity = {
            "samples": _plain(self.samples),
            "outputs": _plain(outputs),
            "outputs_by_format": _plain(by_format),
            "baseline_outputs": _plain(self.reference.outputs),
            "kinds": self.reference.kinds,
            "max_metric_drop": self.spec.max_metric_drop,
        }
        if self.extras.ragged:
            # Outputs that change shape with the batch: verify compares them on the guard's batches.
            size = self.extras.ragged
            parts = [self.samples[k : k + size] for k in range(0, len(self.samples), size)]
            parity["chunks"] = [_plain(self.collate(list(p))) for p in parts]
        if per_sample(state) or self.extras.collate_fn:
            # The batches as the winner makes them (token sequences: the lengths the artifact was
            # checked on), so verify runs it on the same inputs and compares sample by sample.
            batching = state.batching(lengths_of(self.samples))
            parity["batches"] = [{"ids": ids, "batch": _plain(b)} for ids, b in batching.batches(self.samples)]
            parity["mask"] = self.reference.mask
            parity["tokens"] = list(self.extras.token_outputs)
        return parity

    def export(self, config: dict[str, Any], out_dir: str, formats: list[str]) -> dict[str, Any]:
        """Write the winner's artifacts into ``out_dir`` with their parity against the tuned model."""
        import dataclasses as dc
        from pathlib import Path

        from autotune.export import export_artifacts, ship_measured

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
            # Token sequences, or a collate of the user's: batched as the winner batches them.
            "batching": state.batching() if per_sample(state) or self.extras.collate_fn else None,
            # Outputs that change shape with the batch: images of many sizes, so the graph takes any.
            "spatial": bool(self.extras.ragged),
        }
        size, out = state.batch_size, Path(out_dir)
        by_format = {}
        artifacts: dict[str, Any] = {}
        # An OpenVINO winner's IR ships whatever formats were asked for: it is the winner's own file.
        own = state.artifact and state.artifact["format"] in (*formats, "openvino")
        measured = state.artifact if own else None
        if measured is not None:
            # The winner ran an exported file: that file ships, not a re-export of its torch model.
            artifacts = ship_measured(measured, state.model, self.samples, size, out, **_check_args(common))
            by_format[measured["format"]] = collect_outputs(state, self.samples)
        rest = [f for f in formats if f != "onnx" and f not in artifacts]
        example = extras.example_on(state.device)  # on the tuned model's device, as the exporters need
        artifacts.update(export_artifacts(tuned, example, self.samples, size, out, rest, **common))
        if "onnx" in formats and "onnx" not in artifacts:
            artifacts.update(self._export_onnx(state, tuned, out, common, by_format))
        for fmt, record in artifacts.items():
            _label(record, fmt, state, measured)
        # What `autotune verify` re-checks the artifacts against, on any machine: the validation
        # samples and the outputs of the form each artifact was exported from.
        state.model = tuned
        outputs = collect_outputs(state, self.samples)
        kind = _output_kind(tuned, example)
        for record in artifacts.values():
            if kind is not None:  # load() gives the artifact's outputs back as this ModelOutput
                record["output_type"] = kind
        torch.save(self._parity(state, outputs, by_format), out / "parity.pt")
        return {"artifacts": artifacts}

    def held_out(self, baseline: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
        """The metric of the baseline and the winner on the held-out test samples."""
        samples = [self.spec.test_dataset[i] for i in range(len(self.spec.test_dataset))]
        states = [self.build(c) for c in (baseline, best)]
        if per_sample(states[0]):  # token sequences: outputs and mask per sample, on real tokens
            (ref, mask), (out, _) = (collect_per_sample(s, samples) for s in states)
            outputs = [ref, out]
        else:
            outputs, mask = [collect_outputs(s, samples) for s in states], attention_mask(samples)
        chunk, device, metric = self.reference.chunk, self.spec.device, self.spec.metric
        judge = {"kinds": self.reference.kinds, "mask": mask, "collate": self.extras.collate_fn}
        judge["tokens"] = self.extras.token_outputs
        base = evaluate(outputs[0], samples, chunk, device, metric, outputs[0], **judge)
        value = evaluate(outputs[1], samples, chunk, device, metric, outputs[0], **judge)
        return {"n_samples": len(samples), "baseline": base, "best": value, "drop": base - value}

    def diagnose(self, config: dict[str, Any]) -> dict[str, Any]:
        """Samples/s of ``config``'s loader alone and of its model alone (:mod:`autotune.trial.diagnose`)."""
        from autotune.trial.diagnose import diagnose_state

        torch.manual_seed(self.spec.seed)
        return diagnose_state(self.build(config), self.spec.dataset, self.spec.measure)

    def profile(self, config: dict[str, Any], trace: str) -> dict[str, Any]:
        """Where ``config``'s pipeline spends its time (:mod:`autotune.trial.profile`), its trace
        written to ``trace``."""
        from autotune.trial.profile import profile_state

        torch.manual_seed(self.spec.seed)
        state = self.build(config)
        return profile_state(state, self.spec.dataset, trace, seed=draw_seed(self.spec.seed, "profile"))


def _noise_rank(result: dict[str, Any]) -> tuple[bool, float]:
    """Clean before noisy, then the steadier windows first."""
    return (result["noise"] is not None, result["cov"] + result["others_cpu"])


def _halves(state: BuildState, dataset: Any, settings: MeasureSettings, seed: int) -> dict[str, float]:
    """The loader alone and the model alone of ``state``, timed for one short window each."""
    from autotune.trial.diagnose import diagnose_state

    d = diagnose_state(state, dataset, settings, seed)
    return {k: d[k] for k in ("loader_samples_per_s", "model_samples_per_s")}


def _describe_output(out: Any) -> str:
    if out is None:
        return "None"
    return f"a {type(out).__name__}"


def _sort_keys(spec: WorkerSpec) -> list[Any] | None:
    """What ``length_grouping`` or ``size_grouping`` sorts samples by: token sequences' lengths,
    images' shapes and sizes; ``None`` for other samples."""
    if spec.sequence:
        return lengths_of(spec.dataset)
    if spec.images:
        from autotune.shapes import image_sizes, size_keys

        return size_keys(image_sizes(spec.dataset))
    return None


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
    return {k: v for k, v in common.items() if k not in ("fallback", "spatial")}


def _label(record: dict[str, Any], fmt: str, state: BuildState, measured: dict[str, Any] | None) -> None:
    """Say whether an artifact is the measured winner; one that is not is another model, and its
    speed is its own (``autotune verify`` times it), never the winner's speedup. Every way it
    differs is said: a bfloat16 and compiled winner's float32 ONNX lacks both."""
    if record.get("winner"):
        return
    why = record.get("form_note")
    if why is None and record.get("form") == "fallback":  # TorchScript of the float model, not the winner
        why = (
            f"not the tuned model: {record.get('reason') or 'TorchScript could not trace it'}; this is its pruned "
            f"float model, before quantization ({state.quantization}) and the other weight settings"
        )
    if why is None and measured is not None:
        why = f"the winner runs {measured['format']} ({state.runtime}); this is exported from its torch model"
    if why is None and state.runtime != "torch":
        why = f"the winner runs {state.runtime}; this is exported from its torch model"
    if state.compile_mode != "none" and "torch.compile" not in (why or ""):
        compiled = (
            f"the winner runs torch.compile (mode {state.compile_mode}), which no file format carries; "
            "this is its uncompiled module"
        )
        why = compiled if why is None else f"{why}; and {compiled}"
    record["winner"] = why is None
    if why is not None:
        record["form_note"] = why


def _output_kind(model: Any, example: Any) -> str | None:
    """The import path of the model's output class when it is a transformers ``ModelOutput``."""
    from autotune.export.stored import output_type

    try:
        with torch.inference_mode():
            return output_type(call_model(model, example))
    except Exception:  # the outputs were collected already; without the type they stay dicts
        return None


def _plain(obj: Any) -> Any:
    """``obj`` as ``parity.pt`` stores it (:func:`autotune.export.stored.to_stored`): tensors,
    numbers, strings and plain containers, loadable with ``weights_only=True`` and no other globals."""
    from autotune.export.stored import to_stored

    return to_stored(obj)


def _onnx_form(tuned: Any, device: str) -> tuple[Any, str | None]:
    """The form of the tuned model to export to ONNX: itself, except that autocast on the CPU is
    dropped (the exporter would write a bfloat16 graph ONNX Runtime's CPU provider cannot run).
    Parity is then measured against that float32 form, and the metric against the baseline."""
    from autotune.export.parity import exportable

    inner = exportable(tuned)
    if not (device == "cpu" and isinstance(inner, TunedModule) and inner.amp_dtype is not None):
        return tuned, None
    note = (
        f"another model: the winner's weights exported in float32 without its {inner.amp_dtype} autocast "
        "(ONNX Runtime's CPU provider has no such kernels)"
    )
    return wrap(inner, autocast=False), note
