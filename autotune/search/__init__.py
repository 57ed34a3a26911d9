"""The search: the Optuna study and its storage, the search space, the Pareto front and the finalists, parallel workers and their status."""

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
        "choose": "select",
        "pareto_front": "select",
        "open_storage": "storage",
        "run_workers": "parallel",
        "study_status": "status",
        "out_dir_status": "status",
    },
)
