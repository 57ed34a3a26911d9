"""Using a finished run's artifacts: :func:`load` a predictor, :func:`verify` an output directory."""

from autotune._lazy import exports

__all__, __getattr__, __dir__ = exports(
    __name__,
    {
        "load": "entry",
        "Predictor": "load",
        "verify": "verify",
    },
)
