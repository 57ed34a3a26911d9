"""The search: the Optuna study and its storage, the search space, claims from interleaved rounds, the pick among finalists, parallel workers and their status."""

from autotune._lazy import exports

__all__, __getattr__, __dir__ = exports(
    __name__,
    {
        "SearchSpace": "space",
        "list_presets": "space",
        "resolve_space": "space",
        "open_study": "study",
        "run_trials": "study",
        "trial_record": "study",
        "make_sampler": "study",
        "Result": "result",
        "select": "result",
        "confirm": "result",
        "claim_speedup": "result",
        "write_best": "output",
        "interval": "claims",
        "judge": "claims",
        "enough_rounds": "claims",
        "choose": "select",
        "pareto_front": "select",
        "open_storage": "storage",
        "run_workers": "parallel",
        "study_status": "status",
        "out_dir_status": "status",
    },
)
