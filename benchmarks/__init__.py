"""autotune's benchmarks: one folder per workload family (text/, vision/, gpu/, cpu/), the runner
(run.py) and the shared helpers (core.py) at the top; docs/benchmarks.md, "Layout", has the map."""
