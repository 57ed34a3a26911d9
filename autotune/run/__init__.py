"""The run's phase: the options, :func:`optimize` as stages, :func:`plan`, cfg.py files, the finish (the selection and confirmation rounds, the claim, the result files), and applying a found configuration."""

from autotune._lazy import exports

__all__, __getattr__, __dir__ = exports(
    __name__,
    {
        "optimize": "optimize",
        "plan": "plan",
        "apply": "apply",
        "dataloader": "apply",
        "predict": "predict",
        "predictor": "predict",
        "Predictor": "predict",
        "load_config": "cfg",
        "collect": "collect",
        "make_progress": "progress",
        "select": "rounds",
        "confirm": "rounds",
        "claim_speedup": "rounds",
        "write_best": "output",
        "interval": "claims",
        "judge": "claims",
        "enough_rounds": "claims",
    },
)
