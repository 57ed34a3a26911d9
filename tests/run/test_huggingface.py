"""The Hugging Face pipeline as the transformers docs teach it, with the real library: a fast
tokenizer's lists of ints with no padding, ``DataCollatorWithPadding`` in a DataLoader, a BERT
whose last hidden state a small wrapper mean-pools, then ``optimize(model, loader)``, a claim from
confirmation rounds, ``load(out).predict`` and ``verify``. A tiny BERT with random weights and a
tokenizer over a vocabulary written here: nothing is downloaded."""

import json
import random

import torch
from torch.utils.data import DataLoader
from transformers import BertConfig, BertModel, BertTokenizerFast, DataCollatorWithPadding

import autotune

# The machine's load must not veto this: it is about what runs, not about the claim's size.
FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}
WORDS = "the a cat dog sat on mat ran far away fast slow big small red blue house tree car road and".split()


def tokenizer() -> BertTokenizerFast:
    """A WordPiece tokenizer over :data:`WORDS`, with BERT's special tokens and template."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: i for i, token in enumerate(special + WORDS)}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return BertTokenizerFast(
        tokenizer_object=wordpiece,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=32,
    )


class MeanPooled(torch.nn.Module):
    """A sentence embedding: the encoder's last hidden state averaged over the real tokens."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        keep = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * keep).sum(1) / keep.sum(1).clamp(min=1)


def tiny_encoder(vocab_size: int) -> BertModel:
    """A 2-layer BERT of random weights (seeded) over ``vocab_size`` tokens."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return BertModel(config).eval()


def tiny_bert(vocab_size: int) -> MeanPooled:
    return MeanPooled(tiny_encoder(vocab_size)).eval()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(n)]


def test_a_tokenizers_lists_and_a_padding_collator_tune_serve_and_verify(tmp_path):
    tok = tokenizer()
    texts = sentences(40)
    encoded = tok(texts, truncation=True)  # lists of ints, each at its own length
    samples = [{key: encoded[key][i] for key in encoded} for i in range(len(texts))]
    assert isinstance(samples[0]["input_ids"], list) and len({len(s["input_ids"]) for s in samples}) > 1
    collator = DataCollatorWithPadding(tok)
    loader = DataLoader(samples, batch_size=8, collate_fn=collator)
    model = tiny_bert(tok.vocab_size)

    result = autotune.optimize(
        model,
        loader,
        space={"base": None},
        fix={"batch_size": 16},  # a winner other than the baseline: its claim needs confirmation rounds
        n_trials=2,
        out_dir=tmp_path,
        export=("onnx",),
        device="cpu",
        measure=FAST,
        n_verify_pairs=2,
    )
    best = json.loads((tmp_path / "best_config.json").read_text())
    assert best["data"]["collate"] == "user" and result.baseline["batch_size"] == 8
    speedup = best["speedup"]
    assert speedup["method"] == "confirmation rounds" and speedup["n_rounds"] > 0, speedup
    assert speedup["verdict"] in ("speedup", "none", "slower"), speedup
    assert "error" not in best["diagnosis"]

    with torch.inference_mode():
        own = model(**collator(samples)).float()
    served = autotune.load(tmp_path)
    embeddings = torch.stack(served.predict(loader))
    assert embeddings.shape == own.shape
    torch.testing.assert_close(embeddings, own, atol=1e-4, rtol=1e-3)
    checked = autotune.verify(tmp_path)
    assert checked["artifacts"]["onnx"]["status"] == "ok", checked
