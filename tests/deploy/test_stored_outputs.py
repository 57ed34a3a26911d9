"""parity.pt holds a transformers model's outputs (ModelOutput, tuples of tensors) as tensors and
plain containers, reads back with weights_only and nothing else unpickled, and gives the
ModelOutput type back."""

import pickle

import pytest
import torch

from autotune.deploy.load import Predictor, _read_parity
from autotune.export.stored import from_stored, rebuild_output, to_stored
from autotune.trial.inference import _plain

transformers = pytest.importorskip("transformers")


def _bert_outputs():
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 50, (2, 5))
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return {"input_ids": ids}, out


def test_parity_pt_of_a_transformers_model_reads_back(tmp_path):
    sample, out = _bert_outputs()
    assert isinstance(out, transformers.utils.ModelOutput)
    # As the export writes it: per-sample outputs, and a tuple of tensors beside them.
    parity = {"samples": _plain([sample]), "outputs": _plain([out, out]), "baseline_outputs": _plain((out[0], out[1]))}
    torch.save(parity, tmp_path / "parity.pt")
    read = _read_parity(tmp_path)
    for got in read["outputs"]:
        assert type(got) is type(out)
        torch.testing.assert_close(got.last_hidden_state, out.last_hidden_state)
    assert isinstance(read["baseline"], tuple) and len(read["baseline"]) == 2


def test_the_allowlist_holds_nothing_but_plain_data(tmp_path):
    _, out = _bert_outputs()
    torch.save({"samples": [1], "outputs": out}, tmp_path / "raw.pt")  # the ModelOutput itself: not loadable
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "raw.pt", weights_only=True)
    stored = to_stored(out)
    torch.save(stored, tmp_path / "plain.pt")
    assert type(from_stored(torch.load(tmp_path / "plain.pt", weights_only=True))) is type(out)
    # A stored path that names anything but a transformers ModelOutput is not called.
    fields = {"x": torch.zeros(1)}
    for path in ("os:system", "builtins:dict", "transformers:BertConfig", "transformers.utils:ModelOutput.x"):
        assert rebuild_output(path, fields) is fields


def test_a_predictor_gives_the_models_output_type_back():
    sample, out = _bert_outputs()

    def graph(input_ids):  # an exported file's flat outputs
        return out.last_hidden_state, out.pooler_output

    record = {"input_names": ["input_ids"], "output_names": ["last_hidden_state", "pooler_output"]}
    record["output_type"] = to_stored(out)["__autotune_output_type__"]
    pred = Predictor(graph, "onnx", "model.onnx", record, 2, "cpu")
    got = pred(sample)
    assert type(got) is type(out)
    torch.testing.assert_close(got.pooler_output, out.pooler_output)
