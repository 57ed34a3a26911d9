"""cfg.py of the real-text workload: all-MiniLM-L6-v2 on 384 real sentences at natural length.

    python -m benchmarks.predict --cfg benchmarks/text/cfg.py   # claim vs apply + dataloader vs predict

Needs the ``text`` extra and the weights package (see benchmarks/text/workload.py). The samples keep
their own lengths: autotune pads each batch (and may trim and group), as the search measured.
"""

from benchmarks.text.workload import dataset as _sentences
from benchmarks.text.workload import minilm

model = minilm


def dataset() -> list:
    """384 real sentences, tokenized at their natural lengths."""
    return _sentences(384)
