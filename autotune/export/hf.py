"""Hugging Face models among a user's: the transformers model a model is or holds, a
sentence-transformers model and the keyword call every phase makes of it, and the tokenizer a
run was given.

Nothing here imports transformers or sentence-transformers to look: a model can be one of
theirs only where its library is imported already.

Example:
    >>> import torch
    >>> find_hf(torch.nn.Linear(2, 2)) is None
    True
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

__all__ = ["HfModel", "SentenceEmbedding", "as_module", "find_hf", "tokenizer_of"]


def _is_pretrained(module: Any) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def _is_sentence_transformer(module: Any) -> bool:
    library = sys.modules.get("sentence_transformers")
    return library is not None and isinstance(module, library.SentenceTransformer)


class SentenceEmbedding(torch.nn.Module):
    """A ``SentenceTransformer`` behind the call every phase makes of a model: the collated
    batch's tensors by keyword (``model(input_ids=..., attention_mask=...)``), where the model
    itself takes them as one dict.

    Returns the model's own outputs less the inputs it hands back: ``token_embeddings``
    (batch, seq, hidden) and the ``sentence_embedding`` (batch, dim) its pooling, dense and
    normalisation modules make of them, as ``SentenceTransformer.encode`` computes it.

    Args:
        model: The ``sentence_transformers.SentenceTransformer``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **features: torch.Tensor) -> dict[str, torch.Tensor]:
        # A new dict: the model's modules add their outputs to the one they are given.
        out = self.model(dict(features))
        return {key: value for key, value in out.items() if key not in features}


def as_module(model: Any) -> Any:
    """``model`` as every phase calls it: a ``SentenceTransformer`` behind
    :class:`SentenceEmbedding`, anything else as it is."""
    return SentenceEmbedding(model) if _is_sentence_transformer(model) else model


@dataclasses.dataclass(frozen=True)
class HfModel:
    """The Hugging Face model a user's model is or holds.

    Attributes:
        pretrained: The ``transformers.PreTrainedModel``: its ``config`` is the folder's.
        sentence: The ``SentenceTransformer`` that holds it, or ``None``.
        own_outputs: The user's model is ``pretrained`` itself, so an exported graph's outputs
            are that model's own (``last_hidden_state``, ``logits``), as its libraries read them.
    """

    pretrained: Any
    sentence: Any = None
    own_outputs: bool = False


def _outermost(modules: list[Any]) -> list[Any]:
    """Those of ``modules`` not inside another of them (a ``BertModel`` inside a ``BertFor...``)."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def find_hf(model: Any) -> HfModel | None:
    """The Hugging Face model ``model`` is or holds, or ``None``: a transformers model itself; a
    ``SentenceTransformer`` (or a module holding exactly one) and the one transformers model in
    it; or a module holding exactly one transformers model."""
    if not isinstance(model, torch.nn.Module):
        return None
    if _is_pretrained(model):
        return HfModel(model, own_outputs=True)
    sentences = _outermost([m for m in model.modules() if _is_sentence_transformer(m)])
    if len(sentences) == 1:
        inside = _outermost([m for m in sentences[0].modules() if _is_pretrained(m)])
        return HfModel(inside[0], sentence=sentences[0]) if len(inside) == 1 else None
    if sentences:
        return None
    inside = _outermost([m for m in model.modules() if _is_pretrained(m)])
    return HfModel(inside[0]) if len(inside) == 1 else None


def tokenizer_of(collate_fn: Any, pretrained: Any) -> Any | None:
    """The tokenizer a run was given, or ``None``: the collate's (``DataCollatorWithPadding``
    and transformers' other collators keep theirs as ``.tokenizer``), else the one saved beside
    the model's own weights (``name_or_path``), read from the disk only, never downloaded."""
    tokenizer = getattr(collate_fn, "tokenizer", None)
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    name = getattr(pretrained, "name_or_path", "") or ""
    if not name:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # a model built from a config alone, or a cache without its tokenizer
        return None
