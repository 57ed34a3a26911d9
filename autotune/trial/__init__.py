"""One trial, inside its worker: the spec and result types, the runner and its faults, the inference and training contexts, build, measure, guard and diagnose."""

from autotune._lazy import exports

__all__, __getattr__, __dir__ = exports(
    __name__,
    {
        "WorkerSpec": "spec",
        "TrialResult": "spec",
        "Runner": "runner",
        "SubprocessRunner": "runner",
        "InProcessRunner": "inprocess",
        "Context": "context",
        "TrialContext": "inference",
        "TrainContext": "training",
        "build": "build",
        "make_loader": "build",
        "settings_active": "build",
        "measure": "measure",
        "MeasureSettings": "measure",
        "collect_outputs": "guard",
        "make_reference": "guard",
        "evaluate": "fidelity",
        "classify": "faults",
        "diagnose_state": "diagnose",
    },
)
