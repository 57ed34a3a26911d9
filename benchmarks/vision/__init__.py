"""Images: the CRAFT detector with its published weights on rendered pages (:mod:`.workload`), and
the benchmark of baseline, hand recipe and autotune's winner (:mod:`.bench`,
``python -m benchmarks.vision``)."""
