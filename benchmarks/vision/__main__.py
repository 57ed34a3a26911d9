"""``python -m benchmarks.vision``: CRAFT's baseline, hand recipe and winner (:mod:`benchmarks.vision.bench`)."""

from benchmarks.vision.bench import main

if __name__ == "__main__":
    main()
