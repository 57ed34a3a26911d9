"""``autotune doctor``: what this machine can run, as checks with a fix each."""

from autotune._lazy import exports

__all__, __getattr__, __dir__ = exports(
    __name__,
    {
        "Check": "base",
        "run_checks": "core",
        "gather": "core",
        "diagnose": "core",
        "exit_code": "core",
    },
)
