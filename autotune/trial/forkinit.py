"""Imported by a run's fork server (:mod:`autotune.trial.forked`) before it forks any worker:
torch, its compiler's settings (read with the run's environment: the compile cache's folder), the
worker's modules and, by reading the run's payload onto the CPU once, every module
the user's model, data and metric come from, so a forked worker's own read of the payload
imports nothing. Nothing is built or run; a failure only leaves the imports to the workers."""

import os

try:
    import io
    import pickle

    import torch
    import torch._dynamo.config
    import torch._inductor.config

    import autotune.trial.inference
    import autotune.trial.worker  # noqa: F401

    _path = os.environ.get("AUTOTUNE_FORK_PAYLOAD")
    if _path:
        with open(_path, "rb") as _f:
            torch.load(io.BytesIO(_f.read()), map_location="cpu", weights_only=False, pickle_module=pickle)
except Exception:
    pass
