"""The doctor's probes: what only running it shows, each in a fresh Python process.

Whether ONNX Runtime really creates a session on a GPU provider (a provider that fails to load
falls back to the CPU without raising), and whether ``torch.compile`` compiles and runs a tiny
function on a device (with empty caches, so an earlier compile cannot stand in for it). A fresh
process keeps a crash, a hang or a half-loaded library out of the caller.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["compile_probe", "ort_provider_loads"]

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
    """Whether ONNX Runtime really creates a session on ``provider`` here.

    A listed provider whose libraries are missing does not raise: ONNX Runtime logs the
    problem and falls back to the CPU, so this runs a one-node graph in a fresh process and
    reads which providers the session ended up with.

    Returns:
        ``{"ok": bool, "detail": str}``; ``detail`` gives ONNX Runtime's own reason on failure.
    """
    import re
    import subprocess

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


_COMPILE_PROBE = """
import json, sys, time
import torch

device = sys.argv[1]


def f(x):  # a matmul, a pointwise op and a reduction: what inductor fuses in every model
    return torch.nn.functional.gelu(x @ x.T).sum(dim=1)


x = torch.randn(64, 64, device=device)
start = time.perf_counter()
out = torch.compile(f)(x)
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"ok": bool(torch.allclose(out, f(x), rtol=1e-3, atol=1e-3)), "seconds": seconds}))
"""


def compile_probe(device: str, timeout: float) -> dict[str, Any]:
    """Compile and run a tiny function on ``device`` in a fresh process, with empty caches so
    that an earlier compile cannot stand in for this one."""
    import json
    import re
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="autotune-doctor-") as cache:
        child_env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        try:
            done = subprocess.run(
                [sys.executable, "-c", _COMPILE_PROBE, device],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=child_env,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "seconds": timeout, "error": f"did not finish in {timeout:.0f} s"}
    found = re.search(r"^RESULT (.*)$", done.stdout, re.MULTILINE)
    if found:
        result = json.loads(found.group(1))
        return {**result, "error": None if result["ok"] else "compiled, but its outputs differ from eager"}
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return {"ok": False, "seconds": None, "error": (errors or lines or [f"exit code {done.returncode}"])[-1][:300]}
