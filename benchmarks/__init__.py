"""autotune's benchmarks: one folder per workload family (text/, vision/, gpu/, cpu/), whose
``__init__.py`` registers its workloads (:class:`benchmarks.core.Workload`), the runner (run.py)
and the shared helpers (core.py, the registry among them) at the top; docs/benchmarks.md,
"Layout", has the map."""
