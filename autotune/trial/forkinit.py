"""Imported by a run's fork server (:mod:`autotune.trial.forked`) before it forks any worker:
torch, its compiler's settings (read with the run's environment: the compile cache's folder), the
worker's modules and, by reading the run's payload onto the CPU once, every module the user's
model, data and metric come from, so a forked worker's own read of the payload imports nothing.
Nothing is built or run; a failure only leaves the imports to the workers. What the imports made
is left out of the workers' full garbage collections (``gc.freeze``). The payload's file is
removed once read, and a file beside it says the server is ready to fork."""

import os
import sys

# The run's import path (the server's own misses the user's script folder and sys.path edits).
sys.path[:0] = [p for p in os.environ.get("AUTOTUNE_FORK_PATH", "").split(os.pathsep) if p and p not in sys.path]
_path = os.environ.get("AUTOTUNE_FORK_PAYLOAD")
try:
    import io
    import pickle

    import torch
    import torch._dynamo.config
    import torch._inductor.config

    import autotune.trial.inference
    import autotune.trial.worker  # noqa: F401

    if _path:
        with open(_path, "rb") as _f:
            _data = _f.read()
        torch.load(io.BytesIO(_data), map_location="cpu", weights_only=False, pickle_module=pickle)
        del _data
    import gc

    # What the imports made, out of the forked workers' full collections: each worker's first one
    # would walk (and copy, page by page) the server's half a million objects.
    gc.collect()
    gc.freeze()
except Exception:
    pass
finally:
    if _path:
        try:
            os.unlink(_path)
        except OSError:
            pass
    _ready = os.environ.get("AUTOTUNE_FORK_READY")
    if _ready:
        try:
            open(_ready, "w").close()
        except OSError:
            pass
