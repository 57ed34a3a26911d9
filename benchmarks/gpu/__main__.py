"""``python -m benchmarks.gpu``: the GPU headline benchmark (:mod:`benchmarks.gpu.bench`)."""

from benchmarks.gpu.bench import main

if __name__ == "__main__":
    main()
