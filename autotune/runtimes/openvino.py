"""``runtime=openvino``: the tuned model converted by OpenVINO, run on its CPU plugin; its
artifact is the IR, ``model.xml`` with its weights ``model.bin`` beside it.

The candidate is the tuned torch module converted by ``openvino.convert_model`` (or through its
ONNX export), inside its trial, with dynamic batch and sequence axes; in ``int8_static``
(``ov_precision``) it is quantized by NNCF on the run's calibration batches, the layers
``int8_fallback`` keeps float in NNCF's ignored scope. It runs on the CPU plugin with the
inference precision, the performance hint (``ov_hint``) and the thread count (``num_threads``)
of its configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.runtimes.base import Runtime, doctor_row, register, restoring

__all__ = ["OpenVino"]


@register
class OpenVino(Runtime):
    name = "openvino"
    format = "openvino"
    file_name = "model.xml"
    order = 30
    load_rank = 20
    precision_knob = "ov_precision"
    compiles_per_shape = True  # its CPU plugin prepares its kernels for each new shape of a dynamic model
    always_ships = True  # the winner's IR is its own file, whatever formats were asked for
    export_on_request = False  # an IR ships with an OpenVINO winner only: no other winner is converted
    flat_outputs = True
    runs_without_torch = True  # its IR runs with openvino and numpy alone
    packages = ("openvino",)
    help = "OpenVINO (CPU) on the converted model"
    title = "OpenVINO"

    def problem(self, ctx: Any) -> str | None:
        if ctx.env.is_cuda:
            return "OpenVINO runs on the CPU; trials run on CUDA"
        from autotune.export.ov_run import openvino_problem

        return openvino_problem()

    def build(self, state: Any, extras: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
        """The OpenVINO candidate: its IR in ``ov_precision``, compiled with ``ov_hint``. Sets
        ``state.artifact``'s ``precision`` and the compile settings under ``openvino``.

        Raises:
            TrialError: ``unsupported`` when OpenVINO is missing, the device is not the CPU, or
                the model cannot be converted or quantized to hold the guard.
        """
        from autotune.errors import TrialError
        from autotune.export.openvino import OvModule, calibration_feeds, is_transformer, save_openvino
        from autotune.export.ov_run import openvino_problem

        problem = openvino_problem()
        if problem is not None or not str(state.device).startswith("cpu"):
            raise TrialError("unsupported", problem or f"OpenVINO runs on the CPU here, not on {state.device}")
        config = state.config
        example = extras.example_on("cpu")
        model, info = _converted(state, example, bool(extras.ragged), folder)
        precision = config.ov_precision
        if precision == "int8_static":
            from autotune.compress.quantize import serialized_bytes

            state.info["float_bytes"] = serialized_bytes(state.model)  # the weights before int8, beside the IR's
            feeds = calibration_feeds(extras.calibration, info["input_names"])
            model = _int8(model, config, extras, feeds, is_transformer(model), state.info)
        saved = save_openvino(model, folder / self.file_name)
        settings = {
            "precision": "bf16" if precision == "bf16" else "f32",
            "hint": config.ov_hint,
            "threads": config.num_threads or 0,
        }
        module = OvModule(saved["path"], info["input_names"], info["output_names"], **settings)
        measured = module.runner.properties()  # compiles now: a setting the plugin refuses fails here
        state.artifact = {
            "format": self.format,
            "path": saved["path"],
            "input_names": info["input_names"],
            "output_names": info["output_names"],
            "precision": precision,
            "converted_from": info["converted_from"],
            "openvino": settings,
        }
        if "int8_kept" in state.info:  # these layers stay float in the shipped IR
            state.artifact["int8_kept"] = list(state.info["int8_kept"])
        record = {**info, "precision": precision, "bytes": saved["bytes"]}
        record.update({f"plugin_{k}": v for k, v in measured.items()})
        from autotune.export.keyed import keyed

        # The model's dict (or ModelOutput) back from the flat outputs, as the user's code reads it.
        return keyed(module, info["output_names"], info.get("output_type")), record

    def export(
        self, model: Any, example: Any, path: Path, *, device: str, fallback: Any, source: Any, spatial: bool
    ) -> tuple[dict[str, Any], Callable[..., Any]]:
        from autotune.export import file_digest
        from autotune.export.openvino import OvModule, convert_openvino, save_openvino

        converted, info = convert_openvino(model, example, spatial=spatial, onnx_path=path.with_suffix(".onnx"))
        path.with_suffix(".onnx").unlink(missing_ok=True)
        save_openvino(converted, path)
        runner = OvModule(path, info["input_names"], info["output_names"])  # the saved files are what ship
        run = restoring(model, example, runner)
        info.update(
            path=str(path), bin_path=path.with_suffix(".bin").name, bin_sha256=file_digest(path.with_suffix(".bin"))
        )
        return info, run

    def open_file(self, path: Path, artifact: dict[str, Any]) -> Any:
        from autotune.export.openvino import OvModule

        return OvModule(path, artifact["input_names"], artifact["output_names"], **artifact["openvino"])

    def open(self, path: Path, record: dict[str, Any], device: str) -> Any:
        from autotune.export.openvino import OvModule

        # On the CPU: a tensor on another device comes back there.
        return OvModule(path, record["input_names"], record.get("output_names") or [], **(record.get("openvino") or {}))

    def open_light(self, path: Path, record: dict[str, Any]) -> Any:
        from autotune.export.ov_run import OvRunner

        settings = dict(record.get("openvino") or {})
        return OvRunner(path, list(record["input_names"]), list(record.get("output_names") or []), **settings)

    def files(self, path: Path) -> list[Path]:
        return [path.with_suffix(".bin")]

    def ship_files(self, source: Path, path: Path, record: dict[str, Any]) -> None:
        import shutil

        from autotune.export import file_digest

        weights = path.with_suffix(".bin")
        shutil.copyfile(source.with_suffix(".bin"), weights)
        record.update(
            bin_path=weights.name, bin_sha256=file_digest(weights), bytes=record["bytes"] + weights.stat().st_size
        )

    def doctor_facts(self, on_cuda: bool) -> dict[str, Any]:
        """OpenVINO's and NNCF's versions, why OpenVINO cannot run here (``problem``, ``None`` when
        it can), and the CPU plugin's optimization capabilities (``FP32``, ``BF16``, ``INT8``, ...).
        It imports ``openvino``, never NNCF, which imports torch."""
        from importlib import metadata

        from autotune.export.ov_run import core, openvino_problem

        found: dict[str, Any] = {"version": None, "nncf": None, "problem": openvino_problem(), "capabilities": []}
        for key, dist in (("version", "openvino"), ("nncf", "nncf")):
            try:
                found[key] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
        if found["problem"] is None:
            try:
                found["capabilities"] = [str(c) for c in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
            except Exception as exc:  # an older plugin without the property: the rows say unknown
                found["capabilities_error"] = f"{type(exc).__name__}: {exc}"
        return found

    def doctor_checks(self, facts: dict[str, Any]) -> list[dict[str, Any]]:
        """Whether ``runtime=openvino`` is offered (and, where not, why and how to fix it), whether
        NNCF is there for its int8, and whether its bf16 precision pays on this CPU."""
        ov = facts.get(self.name)
        if not isinstance(ov, dict):
            return []  # facts recorded before the section existed
        if "error" in ov:
            return [doctor_row("openvino", "warn", f"cannot be checked: {ov['error']}")]
        if ov.get("problem"):
            return [
                doctor_row(
                    "openvino",
                    "info",
                    f"runtime=openvino is left out: {ov['problem']}",
                    "install the openvino extra (x86-64 Linux) or pip install openvino nncf, to let OpenVINO compete on the CPU",
                )
            ]
        caps = ", ".join(ov.get("capabilities") or []) or "unknown"
        rows = [doctor_row("openvino", "ok", f"{ov['version']}: runtime=openvino is offered on the CPU ({caps})")]
        if ov.get("nncf"):
            rows.append(doctor_row("nncf", "ok", f"{ov['nncf']}: ov_precision=int8_static (NNCF static int8)"))
        else:
            rows.append(
                doctor_row(
                    "nncf",
                    "warn",
                    "not installed: OpenVINO's int8 (ov_precision=int8_static) fails in every trial that tries it",
                    "pip install nncf",
                )
            )
        isa = set((facts.get("cpu") or {}).get("isa") or [])
        if {"avx512_bf16", "amx_bf16"} & isa:
            rows.append(doctor_row("bf16", "ok", "this CPU has bf16 units: ov_precision=bf16 is offered"))
        else:
            rows.append(
                doctor_row("bf16", "info", "no bf16 units on this CPU: ov_precision=bf16 is left out (emulated, slow)")
            )
        return rows


def _converted(state: Any, example: Any, spatial: bool, folder: Path) -> tuple[Any, dict[str, Any]]:
    """``state.model`` converted to OpenVINO, or read from the run's cache where the same torch
    model was converted before (another trial at another batch size, a confirmation's worker,
    the export): ``ov_converted_cached`` in ``state.info`` then, else the seconds the conversion
    took (``ov_convert_s``), which a later build of it skips."""
    from autotune.export.openvino import convert_openvino
    from autotune.export.ov_cache import float_cache

    cache = float_cache(state.model, example, spatial)
    record: dict[str, Any] = {}
    cached = cache.load(record, "ov_converted_cached") if cache is not None and cache.hit() else None
    if cached is not None:
        state.info["ov_converted_cached"] = record.pop("ov_converted_cached")
        return cached, record
    began = time.perf_counter()
    model, info = convert_openvino(state.model, example, spatial=spatial, onnx_path=folder / "model.onnx")
    made_s = time.perf_counter() - began
    if cache is not None and cache.save(model, info):
        state.info["ov_convert_s"] = made_s
    return model, info


# A verdict that int8 does not pay is kept only where the whole-int8 build ran slower than the
# float one: a ratio between this and MIN_INT8_GAIN may be the machine's noise, and is timed again.
_SURELY_SLOWER = 1.0
_AGAIN = "a run with AUTOTUNE_CACHE_DIR=run times it anew"


def _int8(model: Any, config: Any, extras: Any, feeds: list, transformer: bool, info: dict[str, Any]) -> Any:
    """``model`` in NNCF static int8: every layer NNCF takes, or with ``int8_fallback`` the most
    sensitive kept float; read from the run's cache where the same float model, configuration,
    calibration and guard were quantized before (a confirmation's fresh workers and the export
    rebuilt it each time: NNCF and its fallback took 10-15 s a build of real MiniLM). The user's
    metric function is not in the key: a run resumed with another metric reads the layers the
    first kept float."""
    from autotune.compress.fallback import Int8NoGainError
    from autotune.errors import TrialError
    from autotune.export.ov_cache import int8_cache, no_gain_entry

    plan = extras.int8
    guard = None if plan is None else [plan.max_drop, plan.keep, plan.kinds]
    # What NNCF and the fallback read besides the float model (hashed whole): the batch, threads
    # and loader of a trial do not change the IR, so their neighbours read it too.
    settings = dict(
        ov_precision=config.ov_precision, int8_fallback=config.int8_fallback, int8_per_channel=config.int8_per_channel
    )
    cache = int8_cache(model, feeds, [settings, transformer, guard])
    cached = cache.load(info) if cache is not None and cache.hit() else None
    if cached is not None:
        return cached
    # Where a run weighs speed alone, this CPU's verdict that the model does not pay in int8.
    verdict = no_gain_entry(cache) if cache is not None and plan is not None and plan.for_speed else None
    known = verdict.record() if verdict is not None and verdict.hit() else None
    if known is not None and not {"reason", "int8_gain"} <= set(known):  # not ours, or damaged: timed again
        verdict.drop()
        known = None
    if known is not None:
        info.update(int8_gain=known["int8_gain"], int8_gain_cached=True)
        raise TrialError("unsupported", f"{known['reason']} (timed on this CPU by an earlier trial; {_AGAIN})")
    before, began = dict(info), time.perf_counter()
    try:
        quantized = _quantize(model, config, extras, feeds, transformer, info)
    except Int8NoGainError as exc:
        if verdict is not None and exc.gain < _SURELY_SLOWER:
            verdict.publish(lambda folder: None, {"reason": str(exc), "int8_gain": exc.gain})
        raise
    made_s = time.perf_counter() - began
    if cache is not None and cache.save(
        quantized, {k: v for k, v in info.items() if k not in before or before[k] != v}
    ):
        # What a rebuild reading it from the cache skips: the finish prices its rebuilds without it.
        info["int8_made_s"] = made_s
    return quantized


def _quantize(model: Any, config: Any, extras: Any, feeds: list, transformer: bool, info: dict[str, Any]) -> Any:
    from autotune.export.openvino import quantize_openvino

    fallback = config.int8_fallback
    info["int8_transformer"] = transformer
    if fallback == 0:
        return quantize_openvino(model, feeds, transformer=transformer)
    from autotune.compress.fallback import openvino_with_fallback

    quantized, record = openvino_with_fallback(
        model, fallback, extras.calibration, feeds, extras.int8, config, transformer
    )
    info.update(record)
    return quantized
