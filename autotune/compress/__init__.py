"""Compression: structured and unstructured pruning, and INT8 quantization with PyTorch's and torchao's methods."""

from autotune._lazy import exports

__all__, __getattr__, __dir__ = exports(
    __name__,
    {
        "prune_structured_": "prune",
        "prune_unstructured_": "prune",
        "prune_2_4_": "prune",
        "finetune_": "prune",
        "count_macs": "prune",
        "quantize": "quantize",
        "serialized_bytes": "quantize",
    },
)
