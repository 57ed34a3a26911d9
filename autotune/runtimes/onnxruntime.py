"""``runtime=onnxruntime``: the tuned model exported to ONNX (:mod:`autotune.export.onnx`), in
the graph precision of ``ort_precision``, run by an ONNX Runtime session with the provider,
graph optimization and I/O binding of the ``ort_*`` knobs; its artifact is ``model.onnx``."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.runtimes.base import Runtime, doctor_row, register, restoring

__all__ = ["ORT_DEFAULTS", "OnnxRuntime", "ort_provider_loads"]

# The ONNX Runtime settings an exported ONNX artifact is checked (and later loaded) with.
ORT_DEFAULTS = {"provider": "CPUExecutionProvider", "graph_optimization": "all", "intra_op_threads": 0}
# The GPU providers whose loading the doctor tries on CUDA (a listed one may not load).
_PROVIDERS_TO_LOAD = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


@register
class OnnxRuntime(Runtime):
    name = "onnxruntime"
    format = "onnx"
    file_name = "model.onnx"
    order = 20
    load_rank = 0  # first: an ONNX graph runs without Python's model code or torch
    precision_knob = "ort_precision"
    flat_outputs = True
    packages = ("onnxruntime", "onnxruntime-gpu")  # one module, two wheels: either satisfies the other
    no_cpu_autocast = "ONNX Runtime's CPU provider has no such kernels"
    help = "ONNX Runtime on the exported graph"

    def problem(self, ctx: Any) -> str | None:
        if importlib.util.find_spec("onnxruntime") is None:
            return "onnxruntime is not installed"
        import onnxruntime

        return None if onnxruntime.get_available_providers() else "onnxruntime is not installed"

    def build(self, state: Any, extras: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
        from autotune.export import onnx as ox

        example = extras.example_on(state.device)  # the model may be on CUDA; the example is kept on the CPU
        info = ox.export_onnx(state.model, example, folder / self.file_name, spatial=bool(extras.ragged))
        # Read from the run's cache, or what a rebuild reading it skips: the finish prices rebuilds so.
        state.info.update({k: info[k] for k in ("onnx_cached", "onnx_export_s") if k in info})
        path, precision = _in_precision(state, extras, folder / self.file_name)
        module = _session(state, path, info)
        # The graph and session settings that were measured: what the export ships for this winner.
        ort = {"provider": module.provider, "graph_optimization": module.graph_optimization}
        state.artifact = {
            "format": self.format,
            **info,
            "path": str(path),
            "precision": precision,
            "ort": {**ort, "intra_op_threads": module.intra_op_threads},
        }
        if "int8_kept" in state.info:  # the mixed graph: these layers stay float in the shipped file
            state.artifact["int8_kept"] = list(state.info["int8_kept"])
        from autotune.export.keyed import keyed

        # The model's dict (or ModelOutput) back from the flat outputs, as the user's code reads it.
        return keyed(module, info["output_names"], info.get("output_type")), {**info, "precision": precision}

    def export(
        self, model: Any, example: Any, path: Path, *, device: str, fallback: Any, source: Any, spatial: bool
    ) -> tuple[dict[str, Any], Callable[..., Any]]:
        from autotune.export.onnx import OrtModule, export_onnx
        from autotune.export.ort import provider_for

        if source is None:
            info = export_onnx(model, example, path, spatial=spatial)
        else:
            info = _quantized_export(source, example, path, spatial)
        # The provider a session on this device really gets here: the CPU's where ONNX Runtime has no
        # working CUDA provider, so the record says what the check ran on.
        ort = dict(ORT_DEFAULTS, provider=provider_for(device))
        on_gpu = ort["provider"] != ORT_DEFAULTS["provider"]
        runner = OrtModule(path, info["input_names"], info["output_names"], io_binding=on_gpu, **ort)
        info.update(ort=ort)
        # The graph's outputs are flat; a metric expects the model's own structure.
        return info, restoring(model, example, runner)

    def nearest_source(self, state: Any, float_form: Any) -> tuple[Any, str] | None:
        # No ONNX exporter takes torch's int8 modules: the pruned float model, quantized by ONNX
        # Runtime with the same method and weight scales (it has the same dynamic and static int8,
        # not torchao's weight-only), is the nearest form of the winner; where the winner kept
        # layers float, the fewest float on the graph that keep the guard (ranked as
        # ``int8_fallback`` ranks them).
        if float_form is None or state.quantization not in ("int8_dynamic", "int8_static"):
            return None
        from autotune.compress.fallback import onnx_with_fallback

        how = {
            "per_channel": bool(state.config.int8_per_channel),
            "keep": "auto" if state.info.get("int8_kept") else 0,
            "plan": state.extras.int8,
            "config": dict(state.config),
            "fallback": onnx_with_fallback,  # passed in: export sits below compress
        }
        what = f"exported from the pruned float model and quantized by onnxruntime ({state.quantization})"
        return (float_form, state.quantization, state.extras.calibration, how), what

    def load_settings(self, config: Any, device: str) -> dict[str, Any]:
        from autotune.export.ort import provider_for

        # An onnxruntime winner ran its own provider (a fallback is infeasible); for another, what
        # a session on the run's device really gets here: the CPU's where ONNX Runtime cannot load
        # its CUDA provider.
        own = config.runtime == self.name
        return {
            "ort": {
                "provider": config.ort_provider if own else provider_for(device),
                "graph_optimization": config.ort_graph_optimization if own else "all",
                "intra_op_threads": config.num_threads or 0,
            }
        }

    def open_file(self, path: Path, artifact: dict[str, Any]) -> Any:
        from autotune.export.onnx import OrtModule

        return OrtModule(path, artifact["input_names"], artifact["output_names"], **artifact["ort"])

    def open(self, path: Path, record: dict[str, Any], device: str) -> Any:
        import warnings

        import torch

        from autotune.export.onnx import OrtModule
        from autotune.export.ort import CPU_PROVIDER, CUDA_PROVIDER, GPU_PROVIDERS, provider_for, provider_problem

        ort = record.get("ort") or {}
        recorded = ort.get("provider") or ""
        # The recorded GPU provider where a session here gets it, else CUDA's, else the CPU's.
        provider = provider_for(device, recorded if recorded in GPU_PROVIDERS else None)
        if torch.device(device).type == "cuda" and provider == CPU_PROVIDER:
            warnings.warn(
                f"The ONNX artifact runs on ONNX Runtime's CPU provider: {CUDA_PROVIDER} is "
                f"{provider_problem(CUDA_PROVIDER)}. Load with device='cpu', or install the onnxruntime-gpu "
                "built for this CUDA.",
                stacklevel=5,
            )
        return OrtModule(
            path,
            record["input_names"],
            record.get("output_names") or [],
            provider=provider,
            graph_optimization=ort.get("graph_optimization", "all"),
            intra_op_threads=ort.get("intra_op_threads", 0),
            io_binding=provider != CPU_PROVIDER,
        )

    def profiling(self, model: Any, scratch: Path) -> list[Any]:
        import sys

        import torch

        if "autotune.export.onnx" not in sys.modules or not isinstance(model, torch.nn.Module):
            return []  # no session was made in this process
        from autotune.export.onnx import OrtModule

        sessions = [m for m in model.modules() if isinstance(m, OrtModule)]
        for m in sessions:  # a fresh session that records its nodes, from here on
            m.profile_prefix, m._session = str(scratch / "ort"), None
        return sessions

    def profiled(self, sessions: list[Any], n_active: int) -> tuple[list[dict[str, Any]], list[str]]:
        files = [m.session.end_profiling() for m in sessions]
        return [row for f in files for row in _node_rows(f, n_active)], files

    def unprofile(self, sessions: list[Any]) -> None:
        for m in sessions:
            m.profile_prefix, m._session = None, None

    def doctor_facts(self, on_cuda: bool) -> dict[str, Any]:
        """ONNX Runtime's version and providers and, on CUDA, whether its GPU providers load
        (:func:`ort_provider_loads`, each in a fresh process)."""
        if importlib.util.find_spec("onnxruntime") is None:
            return {"version": None, "providers": [], "loads": {}}
        try:
            import onnxruntime
        except Exception as exc:  # a broken install
            return {"version": None, "providers": [], "loads": {}, "error": f"{type(exc).__name__}: {exc}"}
        providers = list(onnxruntime.get_available_providers())
        loads = {p: ort_provider_loads(p) for p in _PROVIDERS_TO_LOAD if on_cuda and p in providers}
        return {"version": onnxruntime.__version__, "providers": providers, "loads": loads}

    def doctor_checks(self, facts: dict[str, Any]) -> list[dict[str, Any]]:
        """The ONNX Runtime install and its providers; on CUDA, whether the GPU providers load."""
        ort, packages = facts[self.name], facts["packages"]
        if ort.get("error"):
            return [
                doctor_row(
                    "onnxruntime",
                    "warn",
                    f"installed but cannot be imported: {ort['error']}",
                    "reinstall it: pip install --force-reinstall onnxruntime-gpu (onnxruntime off Linux x86-64)",
                )
            ]
        if ort.get("version") is None:
            return [
                doctor_row(
                    "onnxruntime",
                    "warn",
                    "not installed: runtime=onnxruntime is left out, and ONNX artifacts cannot be checked for parity",
                    "pip install onnxruntime-gpu (Linux x86-64) or onnxruntime",
                )
            ]
        dists = [d for d in self.packages if packages.get(d)]
        providers = ", ".join(_SHORT.get(p, p) for p in ort["providers"])
        detail = f"{ort['version']} ({', '.join(dists) or '?'}); providers: {providers}"
        rows = [doctor_row("onnxruntime", "ok", detail)]
        if len(dists) == 2:
            rows.append(
                doctor_row(
                    "onnxruntime wheels",
                    "warn",
                    "both onnxruntime and onnxruntime-gpu are installed: they share one module, the last installed wins",
                    "pip uninstall -y onnxruntime onnxruntime-gpu, then pip install onnxruntime-gpu",
                )
            )
        gpus = facts.get("gpus") or []
        on_cuda = isinstance(gpus, list) and any(isinstance(g, dict) and "index" in g for g in gpus)
        for provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
            row = _provider_row(provider, ort, on_cuda)
            if row is not None:
                rows.append(row)
        return rows


def _in_precision(state: Any, extras: Any, path: Path) -> tuple[Path, str]:
    """The exported float graph at ``path`` in ``ort_precision``: the graph to run, and the precision."""
    from autotune.export import onnx as ox

    config, folder = state.config, path.parent
    precision = config.ort_precision
    if precision == "fp16":
        ox.to_fp16(path, folder / "model.fp16.onnx")
        return folder / "model.fp16.onnx", precision
    if not precision.startswith("int8"):
        return path, precision
    state.info["float_bytes"] = path.stat().st_size  # the fp32 graph's size, beside the int8 one
    dst = folder / "model.int8.onnx"
    if config.int8_fallback != 0:
        from autotune.compress.fallback import onnx_with_fallback

        fallback = config.int8_fallback
        state.info.update(onnx_with_fallback(path, dst, precision, fallback, extras.calibration, extras.int8, config))
    else:
        per_channel = bool(config.int8_per_channel)
        ox.quantize_onnx(path, dst, precision, extras.calibration, per_channel=per_channel)
    return dst, precision


def _session(state: Any, path: Path, info: dict[str, Any]) -> Any:
    """The session of ``state``'s ``ort_*`` settings on the graph at ``path``.

    Raises:
        TrialError: ``unsupported`` when ONNX Runtime ran it on another provider than asked.
    """
    from autotune.export.onnx import OrtModule

    config = state.config
    module = OrtModule(
        path,
        info["input_names"],
        info["output_names"],
        provider=config.ort_provider,
        graph_optimization=config.ort_graph_optimization,
        intra_op_threads=config.num_threads or 0,
        io_binding=config.ort_io_binding and config.ort_provider != "CPUExecutionProvider",
    )
    # ONNX Runtime falls back to the CPU when a provider's libraries do not load, without raising:
    # such a trial would be measured on the CPU under the GPU provider's name.
    state.info["ort_provider_ran"] = module.provider_ran
    if module.provider_ran != module.provider:
        from autotune.errors import TrialError

        raise TrialError(
            "unsupported",
            f"ONNX Runtime ran the session on {module.provider_ran}, not on the {module.provider} it was asked "
            "for (its libraries did not load here; `autotune doctor` shows why)",
        )
    return module


def _quantized_export(source: Any, example: Any, path: Path, spatial: bool) -> dict[str, Any]:
    """The nearest exportable form (the pruned float model), quantized on the ONNX side with the
    winner's method: ``source`` is ``(float model, method, calibration[, how])`` (see
    :func:`~autotune.runtimes.artifacts.export_artifacts`' ``onnx_source``); parity is still
    measured against the tuned model."""
    from autotune.export.onnx import export_onnx, quantize_onnx

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
    return info


# --- the doctor's ONNX Runtime section ---------------------------------------------------------

_SHORT = {"CPUExecutionProvider": "CPU", "CUDAExecutionProvider": "CUDA", "TensorrtExecutionProvider": "TensorRT"}


def _provider_row(provider: str, ort: dict[str, Any], on_cuda: bool) -> dict[str, Any] | None:
    listed = provider in ort["providers"]
    if not on_cuda:
        if listed:
            return doctor_row(
                provider, "info", "listed, but there is no CUDA device here: trials use CPUExecutionProvider"
            )
        return None
    if not listed:
        if provider == "TensorrtExecutionProvider":
            return None  # an optional extra; CUDAExecutionProvider is the one that matters
        return doctor_row(
            provider,
            "warn",
            "not in this onnxruntime build: runtime=onnxruntime runs on the CPU provider only",
            "pip uninstall -y onnxruntime, then pip install onnxruntime-gpu",
        )
    load = (ort.get("loads") or {}).get(provider) or {}
    if load.get("ok"):
        return doctor_row(provider, "ok", "loads: a session ran on it")
    fix = (
        "install the CUDA and cuDNN versions the reason names (pip install 'onnxruntime-gpu[cuda,cudnn]'), or an "
        "onnxruntime-gpu built for torch's CUDA; meanwhile --fix ort_provider=CPUExecutionProvider"
    )
    if provider == "TensorrtExecutionProvider":
        fix = "install the TensorRT this onnxruntime-gpu was built with (pip install tensorrt), or --fix ort_provider=CUDAExecutionProvider"
    return doctor_row(
        provider,
        "warn",
        f"listed but does not load ({load.get('detail', 'not tried')}); ONNX Runtime then falls back to the CPU "
        f"silently, so trials with ort_provider={provider} are measured on the CPU",
        fix,
    )


_ORT_PROBE = """
import sys
import torch  # as in a trial: torch's CUDA libraries are loaded before the session is made
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
model.ir_version = 8
session = ort.InferenceSession(model.SerializeToString(), providers=[sys.argv[1], "CPUExecutionProvider"])
session.run(None, {"x": np.ones(2, np.float32)})
print("PROVIDERS " + ",".join(session.get_providers()))
"""


def ort_provider_loads(provider: str, timeout: float = 120.0) -> dict[str, Any]:
    """Whether ONNX Runtime really creates a session on ``provider`` here, for the doctor.

    A listed provider whose libraries are missing does not raise: ONNX Runtime logs the
    problem and falls back to the CPU, so this runs a one-node graph in a fresh process (a
    crash, a hang or a half-loaded library stays out of the caller) and reads which providers
    the session ended up with.

    Returns:
        ``{"ok": bool, "detail": str}``; ``detail`` gives ONNX Runtime's own reason on failure.
    """
    import re
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-c", _ORT_PROBE, provider], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"creating a session did not finish in {timeout:.0f} s"}
    found = re.search(r"^PROVIDERS (.*)$", done.stdout, re.MULTILINE)
    if found and provider in found.group(1).split(","):
        return {"ok": True, "detail": "a session ran on it"}
    log = re.sub(r"\x1b\[[0-9;]*m", "", done.stderr)
    reasons = re.findall(r"with error: (.+)", log) + re.findall(r"(Require [^.]+)\.", log)
    if not reasons:
        reasons = [line.strip() for line in log.splitlines() if line.strip()][-1:] or ["no reason logged"]
    return {"ok": False, "detail": "; ".join(dict.fromkeys(r.strip() for r in reasons))}


def _node_rows(path: str, n_active: int) -> list[dict[str, Any]]:
    """Node times of the last ``n_active`` runs in an ONNX Runtime profile, by node type."""
    import json

    events = json.loads(Path(path).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[-n_active:]
    rows: dict[str, dict[str, Any]] = {}
    heaviest: dict[str, float] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or "op_name" not in args:
            continue
        if not any(a <= e["ts"] <= b for a, b in runs):
            continue
        name = "onnxruntime::" + args["op_name"]
        row = rows.setdefault(name, {"name": name, "self_us": 0.0, "calls": 0, "input_shapes": ""})
        row["self_us"] += float(e["dur"])
        row["calls"] += 1
        if e["dur"] > heaviest.get(name, -1.0):
            heaviest[name] = float(e["dur"])
            shapes = [list(v) for s in args.get("input_type_shape") or [] for v in s.values()]
            row["input_shapes"] = str(shapes)
    return list(rows.values())
