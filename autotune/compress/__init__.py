"""Compression: structured and unstructured pruning, INT8 quantization with PyTorch's and torchao's methods, and the sensitivity ranking that keeps a model's most fragile layers float."""

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
        "METHODS": "sensitivity",
        "Ranking": "sensitivity",
        "worst_cosine": "sensitivity",
        "max_rel_error": "sensitivity",
        "onnx_layers": "sensitivity_onnx",
        "rank_onnx": "sensitivity_onnx",
        "quantize_onnx_except": "sensitivity_onnx",
        "fallback_onnx": "sensitivity_onnx",
        "torch_layers": "sensitivity_torch",
        "rank_torch": "sensitivity_torch",
        "quantize_torch_except": "sensitivity_torch",
        "fallback_torch": "sensitivity_torch",
    },
)
