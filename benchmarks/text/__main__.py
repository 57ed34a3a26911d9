"""``python -m benchmarks.text``: the real-text hand recipes, checked then timed (:mod:`benchmarks.text.recipes`)."""

from benchmarks.text.recipes import main

if __name__ == "__main__":
    main()
