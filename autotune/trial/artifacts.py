"""The winner's artifacts, written inside its worker: exported in the formats asked for (or the
file it ran shipped as it is), each labelled as the measured winner or another model, with the
parity data ``autotune verify`` re-checks them against.
"""

from __future__ import annotations

from typing import Any

import torch

from autotune.batching import lengths_of
from autotune.config import Config, values_of, with_values
from autotune.knobs import declared
from autotune.knobs.state import BuildState, TunedModule, wrap
from autotune.samples import call_model
from autotune.trial.build import build
from autotune.trial.guard import collect_outputs, per_sample


def _check_args(common: dict[str, Any]) -> dict[str, Any]:
    """The parity-check arguments among :func:`~autotune.runtimes.artifacts.export_artifacts`' keywords."""
    return {k: v for k, v in common.items() if k not in ("fallback", "spatial")}


def _label(
    record: dict[str, Any],
    fmt: str,
    state: BuildState,
    measured: dict[str, Any] | None,
    compile_mode: str | None = None,
) -> None:
    """Say whether an artifact is the measured winner; one that is not is another model, and its
    speed is its own (``autotune verify`` times it), never the winner's speedup. Every way it
    differs is said: a bfloat16 and compiled winner's float32 ONNX lacks both. ``compile_mode``:
    the winner's (default: ``state``'s), where ``state`` was built without it for the export."""
    compile_mode = compile_mode or state.compile_mode
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
    if compile_mode != "none" and "torch.compile" not in (why or ""):
        compiled = (
            f"the winner runs torch.compile (mode {compile_mode}), which no file format carries; "
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


def _export_form(runtime: Any, tuned: Any, device: str) -> tuple[Any, str | None]:
    """The form of the tuned model ``runtime``'s file is exported from: itself, except that
    autocast on the CPU is dropped where the runtime cannot run the graph the exporter would
    write (ONNX Runtime's CPU provider and a bfloat16 graph). Parity is then measured against
    that float32 form, and the metric against the baseline."""
    from autotune.export.parity import exportable

    inner = exportable(tuned)
    why = runtime.no_cpu_autocast
    if why is None or not (device == "cpu" and isinstance(inner, TunedModule) and inner.amp_dtype is not None):
        return tuned, None
    note = f"another model: the winner's weights exported in float32 without its {inner.amp_dtype} autocast ({why})"
    return wrap(inner, autocast=False), note


class ArtifactExport:
    """The winner's export, a base of :class:`autotune.trial.inference.TrialContext`: it uses
    the context's ``spec``, ``samples``, ``extras``, ``reference``, ``collate``, ``model`` (the
    user's, untouched) and ``fresh_model``."""

    def _export_other(
        self, fmt: str, state: Any, tuned: Any, out: Any, common: dict[str, Any], by_format: dict[str, Any]
    ) -> dict[str, Any]:
        """The ``fmt`` artifact of a winner that ran no such file: its export or, where that fails,
        the nearest form its runtime knows (:meth:`~autotune.runtimes.base.Runtime.nearest_source`)."""
        from autotune.runtimes.artifacts import export_artifacts
        from autotune.runtimes.base import by_format as runtime_of

        runtime = runtime_of(fmt)
        size, example = state.batch_size, self.extras.example_on(state.device)
        model, note = _export_form(runtime, tuned, state.device)
        got = export_artifacts(model, example, self.samples, size, out, [fmt], **common)
        if got[fmt]["status"] == "failed":
            float_form = None if state.float_model is None else wrap(state, state.float_model, autocast=False)
            nearest = runtime.nearest_source(state, float_form)
            if nearest is not None:
                (source, what), first = nearest, got[fmt].get("error")
                got = export_artifacts(model, example, self.samples, size, out, [fmt], onnx_source=source, **common)
                note = f"{what}: {first}"
        if note:
            got[fmt]["form_note"] = note
            keep = state.model
            state.model = model
            by_format[fmt] = collect_outputs(state, self.samples)
            state.model = keep
        return got

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

        from autotune.export.hf_layout import write_hf_layout
        from autotune.runtimes.artifacts import ship_measured
        from autotune.runtimes.base import by_format as runtime_of

        # No file format carries torch.compile: the files are exported from, and checked against,
        # the uncompiled module, which is built without compiling it (a compiled MiniLM pick's
        # export spent 40 s compiling for parity outputs no artifact was made from).
        compile_mode = values_of(config).compile_mode
        eager = with_values(config, compile_mode="none", compile_dynamic=False) if compile_mode != "none" else config
        reference = self.reference  # made before the extras are copied: it completes them
        extras = dc.replace(self.extras, keep_float=True)
        state = build(self.fresh_model(), Config(eager), self.spec.device, extras=extras, copy_model=False)
        # A TorchScript or ONNX Runtime winner is exported from the torch model it was made from.
        tuned = state.torch_model if state.torch_model is not None else state.model
        common = {
            "fallback": state.float_model,
            "metric": self.spec.metric,
            "baseline_metric": reference.metric,
            "max_metric_drop": self.spec.max_metric_drop,
            "baseline_outputs": reference.outputs,
            "kinds": reference.kinds,
            "mask": reference.mask,
            "metric_chunk": reference.chunk,
            # Token sequences, or a collate of the user's: batched as the winner batches them.
            "batching": state.batching() if per_sample(state) or self.extras.collate_fn else None,
            # Outputs that change shape with the batch: images of many sizes, so the graph takes any.
            "spatial": bool(self.extras.ragged),
            # Each model's outputs, computed once for every file checked against it.
            "memo": {},
        }
        size, out = state.batch_size, Path(out_dir)
        by_format = {}
        artifacts: dict[str, Any] = {}
        # An OpenVINO winner's IR ships whatever formats were asked for: it is the winner's own file.
        own = state.artifact and (
            state.artifact["format"] in formats or runtime_of(state.artifact["format"]).always_ships
        )
        measured = state.artifact if own else None
        if measured is not None:
            # The winner ran an exported file: that file ships, not a re-export of its torch model.
            artifacts = ship_measured(measured, state.model, self.samples, size, out, **_check_args(common))
            by_format[measured["format"]] = collect_outputs(state, self.samples)
        example = extras.example_on(state.device)  # on the tuned model's device, as the exporters need
        for fmt in [f for f in formats if f not in artifacts]:
            artifacts.update(self._export_other(fmt, state, tuned, out, common, by_format))
        for fmt, record in artifacts.items():
            _label(record, fmt, state, measured, compile_mode)
        # A Hugging Face model's files also in the folder its libraries load (hf/).
        write_hf_layout(self.model, self.extras.collate_fn, out, artifacts)
        # What `autotune verify` re-checks the artifacts against, on any machine: the validation
        # samples and the outputs of the form each artifact was exported from.
        state.model = tuned
        # The outputs a parity check computed already where one ran against this model, batched
        # as the winner batches them (a second of real MiniLM to compute again).
        plain = not any(state.settings.get(k) for k in declared("numerics"))  # the checks ran without them
        outputs = common["memo"].get(id(tuned)) if per_sample(state) and plain else None
        outputs = collect_outputs(state, self.samples) if outputs is None else outputs
        kind = _output_kind(tuned, example)
        for record in artifacts.values():
            if kind is not None:  # load() gives the artifact's outputs back as this ModelOutput
                record["output_type"] = kind
        torch.save(self._parity(state, outputs, by_format), out / "parity.pt")
        return {"artifacts": artifacts, "build_inputs": self._build_inputs(config, out)}

    def _build_inputs(self, config: dict[str, Any], out: Any) -> dict[str, Any] | None:
        """The batches the winner was built from, kept beside it for ``apply`` without a dataset."""
        from autotune.export.build_inputs import FILE, write_build_inputs
        from autotune.knobs import off_default

        if not off_default(config, "reads_inputs"):  # a runtime other than torch, int8 or pruning
            (out / FILE).unlink(missing_ok=True)  # an earlier pick's, exported before the selection
            return None
        # ragged: outputs that change shape with the input, so a rebuilt graph takes any size too
        return {**write_build_inputs(out, self.extras.example, self.extras.calibration), "ragged": self.extras.ragged}
