"""A runtime's outputs in the model's own structure.

ONNX Runtime and OpenVINO return a graph's outputs flat (one tensor, or a tuple); a model that
returns a dict of tensors (a transformers ``ModelOutput``, a ``SentenceTransformer``'s features)
is read by key in the user's code (``out["sentence_embedding"]``, ``out.last_hidden_state``).
:func:`keyed` gives a runtime module the model's dict back, by the output names the export took
from the model's keys, and its ``ModelOutput`` class where it had one: what ``apply``,
``predict`` and ``predictor`` return is then what the model returned, as ``load()`` already gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["KeyedOutputs", "keyed", "names_are_keys"]


def names_are_keys(names: Sequence[str]) -> bool:
    """Whether an export's output names are the model's dict keys (not ``output``, ``output_0``...).

    Example:
        >>> names_are_keys(["last_hidden_state", "pooler_output"]), names_are_keys(["output_0", "output_1"])
        (True, False)
    """
    return bool(names) and not names[0].startswith("output")


class KeyedOutputs(nn.Module):
    """``module``'s flat outputs as a dict by ``names`` (a ``ModelOutput`` of ``output_type``
    where given), called as ``module`` is."""

    def __init__(self, module: nn.Module, names: Sequence[str], output_type: str | None = None) -> None:
        super().__init__()
        self.module, self.names, self.output_type = module, list(names), output_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        keyed = dict(zip(self.names, out if isinstance(out, tuple) else (out,), strict=True))
        if self.output_type:
            from autotune.export.stored import rebuild_output

            return rebuild_output(self.output_type, keyed)
        return keyed


def keyed(module: nn.Module, names: Sequence[str], output_type: str | None = None) -> nn.Module:
    """``module`` giving the model's dict back where its output names are the model's keys."""
    return KeyedOutputs(module, names, output_type) if names_are_keys(names) else module
