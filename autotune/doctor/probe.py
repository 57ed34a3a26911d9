"""The doctor's probes: what only running it shows, each in a fresh Python process.

Whether ``torch.compile`` compiles and runs a tiny function on a device (with empty caches, so an
earlier compile cannot stand in for it). A fresh process keeps a crash, a hang or a half-loaded
library out of the caller. A runtime's own probes are its own (ONNX Runtime's, whether a session
really runs on a GPU provider: :func:`autotune.runtimes.onnxruntime.ort_provider_loads`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["compile_probe"]

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
