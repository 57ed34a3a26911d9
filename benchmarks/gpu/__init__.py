"""One CUDA GPU: the models and data (:mod:`.models`, :mod:`.workloads`), the headline benchmark
(:mod:`.bench`, ``python -m benchmarks.gpu``) and its timing (:mod:`.timing`), and the GPU check
(:mod:`.check`, ``python -m benchmarks.gpu.check``) with its pytest plugin (:mod:`.check_log`)."""
