"""A Hugging Face model's winner in the folder its users' libraries load (``out/hf``): its
config and tokenizer beside ``model.onnx`` and ``openvino_model.xml``, opened by optimum-intel's
``OVModelForFeatureExtraction``, ONNX Runtime's ``ORTModelForFeatureExtraction`` and Sentence
Transformers' ``backend="onnx"``/``"openvino"``, each giving the tuned model's embeddings.

A tiny BERT with random weights, a WordPiece tokenizer over a vocabulary written here and a
sentence-transformers model built from them: nothing is downloaded. Each library's test is
skipped where it cannot be installed (optimum-intel and optimum-onnx cap transformers below
some versions the suite runs with); the folder's files and names are checked everywhere.
"""

import importlib
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import autotune
from autotune.export.hf import SentenceEmbedding, as_module, find_hf
from autotune.export.hf_layout import write_hf_layout
from tests.run.test_huggingface import sentences, tiny_encoder, tokenizer

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need the dev extra")
pytest.importorskip("openvino", reason="runtime=openvino needs the openvino extra")

FAST = {"n_windows": 2, "window_s": 0.05, "warmup_batches": 1, "n_remeasure": 0, "max_others_cpu": 1.0, "max_cov": 1.0}
TEXTS = sentences(24, seed=3)


def _optimize(model, tok, out):
    """A short run whose winner runs OpenVINO (its IR ships, the ONNX export beside it), batched
    by ``DataCollatorWithPadding`` as users batch."""
    encoded = tok(TEXTS, truncation=True)
    samples = [{key: encoded[key][i] for key in encoded} for i in range(len(TEXTS))]
    loader = DataLoader(samples, batch_size=8, collate_fn=transformers.DataCollatorWithPadding(tok))
    return autotune.optimize(
        model,
        loader,
        space={"base": None, "runtime": ["torch", "openvino"]},
        fix={"runtime": "openvino"},
        n_trials=2,
        n_val=16,
        out_dir=out,
        export=("onnx",),
        device="cpu",
        measure=FAST,
        n_verify_pairs=1,
        isolation="inprocess",
        profile=False,  # where the winner's time goes is not this test's question
    )


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    """A BertModel's OpenVINO IR, exported and checked as a run's export does, and its folder
    written from the model and the run's collate (the run's own hook is the sentence test's)."""
    from autotune.batching import Batching
    from autotune.runtimes.artifacts import export_artifacts

    tok, out = tokenizer(), tmp_path_factory.mktemp("bert-hf")
    model = tiny_encoder(tok.vocab_size)
    collator = transformers.DataCollatorWithPadding(tok)
    encoded = tok(TEXTS, truncation=True)
    samples = [{key: encoded[key][i] for key in encoded} for i in range(len(TEXTS))]
    batching = Batching(batch_size=8, collate_fn=collator)
    artifacts = export_artifacts(model, collator(samples[:8]), samples, 8, out, ["openvino"], batching=batching)
    assert artifacts["openvino"]["status"] == "ok", artifacts
    write_hf_layout(model, collator, out, artifacts)
    return out, artifacts, tok


@pytest.fixture(scope="module")
def sentence_run(tmp_path_factory):
    """A SentenceTransformer (mean pooling, unit length) whose OpenVINO winner ships its IR, and
    its ONNX export beside it."""
    st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")
    tok, folder = tokenizer(), tmp_path_factory.mktemp("tiny-bert")
    tiny_encoder(tok.vocab_size).save_pretrained(folder)
    tok.save_pretrained(folder)
    try:  # where sentence-transformers 6 keeps its modules; 5 had them in `models`
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules
    encoder = modules.Transformer(str(folder))
    pooling = modules.Pooling(32, "mean")  # the BERT's hidden size
    model = st.SentenceTransformer(modules=[encoder, pooling, modules.Normalize()], device="cpu").eval()
    out = tmp_path_factory.mktemp("sentence-hf")
    result = _optimize(model, tok, out)  # a SentenceTransformer goes in as it is
    assert result.best_config["runtime"] == "openvino"
    return out, model


def _optimum(module: str, name: str):
    """optimum's class ``name``, or a skip where it cannot be imported here (optimum-intel and
    optimum-onnx cap transformers below some of the versions the suite runs with)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        pytest.skip(f"{module}.{name} cannot be imported here: {exc}")


def _tokens(tok, texts=TEXTS[:5]):
    return dict(tok(texts, padding=True, return_tensors="pt"))


def _hidden_close(hidden, reference, mask):
    """Every real token's hidden state at cosine > 0.99 to the reference's."""
    hidden, reference = torch.as_tensor(np.asarray(hidden)), torch.as_tensor(np.asarray(reference))
    keep = mask.bool()
    cosine = torch.nn.functional.cosine_similarity(hidden[keep], reference[keep], dim=-1)
    assert cosine.min() > 0.99, cosine.min()


def _served(out, batch, fmt):
    """The artifact's outputs (the tuned model's, checked for parity), through ``autotune.load``."""
    return autotune.load(out, format=fmt)(batch)


def _ir_hidden(out, artifacts, batch):
    """The exported IR's ``last_hidden_state`` (checked for parity with the model), run by name."""
    from autotune.export.openvino import OvModule

    record = artifacts["openvino"]
    module = OvModule(out / record["path"], record["input_names"], record["output_names"])
    return module(**batch)[record["output_names"].index("last_hidden_state")]


def _names(folder):
    return {p.name for p in folder.iterdir()}


def test_a_bert_model_has_its_config_and_tokenizer_beside_its_ir(bert_run):
    out, artifacts, tok = bert_run
    folder = out / "hf"
    assert {"config.json", "tokenizer_config.json", "openvino_model.xml", "openvino_model.bin"} <= _names(folder)
    assert artifacts["openvino"]["hf"] == {
        "path": "hf/openvino_model.xml",
        "tokenizer": True,
        "sentence_transformers": False,
    }
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.model_type == "bert" and config.architectures == ["BertModel"]
    again = transformers.AutoTokenizer.from_pretrained(folder)
    assert again(TEXTS[:3])["input_ids"] == tok(TEXTS[:3])["input_ids"]


def test_the_ir_takes_and_gives_the_names_optimum_uses(bert_run):
    import openvino as ov

    out, artifacts, tok = bert_run
    batch = _tokens(tok)
    compiled = ov.Core().compile_model(str(out / "hf" / "openvino_model.xml"), "CPU")
    assert {i.get_any_name() for i in compiled.inputs} == set(batch)
    hidden = compiled({k: v.numpy() for k, v in batch.items()})[compiled.output("last_hidden_state")]
    _hidden_close(hidden, _ir_hidden(out, artifacts, batch), batch["attention_mask"])


def test_optimum_intel_loads_the_openvino_winner(bert_run):
    loader = _optimum("optimum.intel", "OVModelForFeatureExtraction")
    out, artifacts, _tok = bert_run
    model = loader.from_pretrained(out / "hf")
    batch = _tokens(transformers.AutoTokenizer.from_pretrained(out / "hf"))
    hidden = model(**batch).last_hidden_state
    _hidden_close(hidden, _ir_hidden(out, artifacts, batch), batch["attention_mask"])


def test_a_sentence_transformer_goes_in_as_every_phase_calls_it(sentence_run):
    out, model = sentence_run
    artifacts = json.loads((out / "best_config.json").read_text())["artifacts"]
    for fmt in ("onnx", "openvino"):
        assert artifacts[fmt]["status"] == "ok", artifacts[fmt]
        assert artifacts[fmt]["output_names"] == ["token_embeddings", "sentence_embedding"]
        assert artifacts[fmt]["hf"]["sentence_transformers"] is True
    names = _names(out / "hf")
    assert {"modules.json", "config.json", "model.onnx", "openvino_model.xml", "tokenizer_config.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)  # the untuned weights do not ship
    served = _served(out, _tokens(model.tokenizer), "onnx")["sentence_embedding"]
    own = model.encode(TEXTS[:5], convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(served, own).min() > 0.99
    # The artifacts under their own names still serve, as load() reads them.
    assert autotune.load(out, format="openvino").path.name == "model.xml"
    # The user's own process: the SentenceTransformer as it is, tuned as the run found.
    encoded = model.tokenizer(TEXTS[:5], truncation=True)
    samples = [{key: encoded[key][i] for key in encoded} for i in range(5)]
    outputs = autotune.predict(model, samples, out, collate_fn=transformers.DataCollatorWithPadding(model.tokenizer))
    tuned = torch.stack([o["sentence_embedding"] for o in outputs])
    assert torch.nn.functional.cosine_similarity(tuned, own).min() > 0.99


def test_the_sentence_graphs_name_their_token_embeddings_as_optimum_reads_them(sentence_run):
    import onnxruntime as ort
    import openvino as ov

    out, model = sentence_run
    batch = _tokens(model.tokenizer)
    session = ort.InferenceSession(str(out / "hf" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["last_hidden_state", "sentence_embedding"]
    (hidden,) = session.run(["last_hidden_state"], {i.name: batch[i.name].numpy() for i in session.get_inputs()})
    _hidden_close(hidden, _served(out, batch, "onnx")["token_embeddings"], batch["attention_mask"])
    ir = ov.Core().read_model(str(out / "hf" / "openvino_model.xml"))
    assert [o.get_names() for o in ir.outputs] == [{"last_hidden_state"}, {"sentence_embedding"}]


def test_onnx_runtimes_optimum_class_loads_the_onnx_artifact(sentence_run):
    loader = _optimum("optimum.onnxruntime", "ORTModelForFeatureExtraction")
    out, _model = sentence_run
    model = loader.from_pretrained(out / "hf")
    batch = _tokens(transformers.AutoTokenizer.from_pretrained(out / "hf"))
    hidden = model(**batch).last_hidden_state
    _hidden_close(hidden, _served(out, batch, "onnx")["token_embeddings"], batch["attention_mask"])


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_sentence_transformers_loads_the_winner_with_its_backend(sentence_run, backend):
    if backend == "onnx":  # what Sentence Transformers loads each backend's graph with
        _optimum("optimum.onnxruntime", "ORTModelForFeatureExtraction")
    else:
        _optimum("optimum.intel", "OVModelForFeatureExtraction")
    import sentence_transformers as st

    out, model = sentence_run
    loaded = st.SentenceTransformer(str(out / "hf"), backend=backend, device="cpu")
    embeddings = loaded.encode(TEXTS, convert_to_tensor=True)
    served = _served(out, _tokens(model.tokenizer, TEXTS), backend)["sentence_embedding"]
    assert torch.nn.functional.cosine_similarity(embeddings, served).min() > 0.99


class _Pooled(torch.nn.Module):
    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.mean(1)


def test_a_wrappers_graph_is_left_out_with_the_reason(tmp_path):
    model = _Pooled(tiny_encoder(30))
    assert find_hf(model).pretrained is model.encoder and not find_hf(model).own_outputs
    artifacts = {"onnx": {"status": "ok", "path": "model.onnx", "output_names": ["output"]}}
    write_hf_layout(model, None, tmp_path, artifacts)
    assert "not the transformers model's own" in artifacts["onnx"]["hf"]["error"]
    assert not (tmp_path / "hf").exists()
    assert isinstance(as_module(model), _Pooled) and not isinstance(as_module(model), SentenceEmbedding)
