"""predictor() and predict(): a tuned model built once, run through the tuned loader, outputs in
dataset order; a model apply() returned is used as it is and never tuned twice."""

import pytest
import torch

import autotune
from autotune.batching import Batching, gather_outputs, pad_collate, split_samples
from tests.models import MLP, TextEncoder, classification_data, text_data

GROUPED = {"batch_size": 8, "padding": "trim", "length_grouping": 4}
ORT_STATIC = {"batch_size": 16, "runtime": "onnxruntime", "ort_precision": "int8_static"}


class Tagger(TextEncoder):
    """Token-level outputs beside a vector: per-position states (B, S, 32), ids (B, S), the first state (B, 32)."""

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.encoder(
            self.embed(input_ids) + self.position(positions), src_key_padding_mask=attention_mask == 0
        )
        return {"tokens": hidden, "ids": input_ids * 2, "first": hidden[:, 0]}


def _one_by_one(model, samples):
    with torch.inference_mode():
        return [model(**{k: v[None] for k, v in s.items()}) for s in samples]


def test_outputs_of_grouped_batches_come_back_in_dataset_order_with_each_samples_own_tokens():
    data = text_data(50)
    out = autotune.predict(Tagger(), data, GROUPED, device="cpu")
    own = _one_by_one(Tagger().eval(), data)
    assert len(out) == len(data)
    for got, ref, sample in zip(out, own, data, strict=True):
        assert got["tokens"].shape == (len(sample["input_ids"]), 32)
        torch.testing.assert_close(got["tokens"], ref["tokens"][0], atol=1e-5, rtol=1e-4)
        assert torch.equal(got["ids"], ref["ids"][0])
        torch.testing.assert_close(got["first"], ref["first"][0], atol=1e-5, rtol=1e-4)


def test_gather_outputs_equals_splitting_each_batch_sample_by_sample():
    data = text_data(37, seed=3)
    batching = Batching(
        batch_size=5, collate_fn=pad_collate, padding="trim", grouping=4, lengths=[len(s["input_ids"]) for s in data]
    )
    model = Tagger().eval()
    chunks, order, expected = [], [], [None] * len(data)
    with torch.inference_mode():
        for ids, batch in batching.batches(data):
            out = model(**batch)
            chunks.append((out, batch["attention_mask"]))
            order += ids
            for i, piece in zip(ids, split_samples(out, batch), strict=True):
                expected[i] = {k: v[0] for k, v in piece.items()}
    for got, ref in zip(gather_outputs(chunks, order), expected, strict=True):
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_predictor_builds_the_model_once_for_every_call():
    built = []

    def make():
        built.append(1)
        return MLP()

    data = classification_data(40)
    run = autotune.predictor(make, {"batch_size": 16}, device="cpu")
    first, second = run(data), run.predict(data)
    assert len(built) == 1
    expected = MLP().eval()(torch.stack([x for x, _ in data])).detach()
    # One tensor per batch: the outputs come stacked (no object per sample until one is read).
    torch.testing.assert_close(first.tensor, expected)
    assert len(first) == len(data) and torch.equal(first[3], expected[3])
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_predict_uses_an_onnxruntime_int8_model_apply_returned_as_it_is():
    data = classification_data(64)
    fast = autotune.apply(MLP(), ORT_STATIC, device="cpu", dataset=data)
    with torch.inference_mode():
        expected = torch.cat([fast(torch.stack([x for x, _ in data[k : k + 16]])) for k in range(0, 64, 16)])
    for config in (ORT_STATIC, None):  # with the config it was built with, or none
        out = autotune.predict(fast, data, config)
        torch.testing.assert_close(torch.stack(list(out)), expected)


def test_an_applied_model_is_refused_where_it_would_be_tuned_again():
    fast = autotune.apply(MLP(), {"batch_size": 8, "amp_dtype": "bfloat16"}, device="cpu")
    with pytest.raises(
        autotune.ConfigError, match=r"already what autotune\.apply returned.*pass the original model\.$"
    ):
        autotune.apply(fast, {"batch_size": 8})
    with pytest.raises(autotune.ConfigError, match=r"another config: pass the original model"):
        autotune.predict(fast, classification_data(8), {"batch_size": 4})
    with pytest.raises(autotune.ConfigError, match=r"needs the config"):
        autotune.predictor(MLP())


def test_a_predictor_called_again_on_the_same_samples_reuses_its_loader():
    data = classification_data(40)
    run = autotune.predictor(MLP(), {"batch_size": 8, "num_workers": 1, "persistent_workers": True}, device="cpu")
    first = run(data)
    loader = run._cached[1]
    second = run(data)
    assert run._cached[1] is loader  # no new loader, no new worker process, per call
    assert torch.equal(first.tensor, second.tensor)
    run(classification_data(24))  # other samples: a loader of their own
    assert run._cached[1] is not loader


def test_a_pass_leaves_the_objects_alive_before_it_out_of_full_collections_and_takes_them_back():
    """A full collection walks every object the process holds (135 ms after torch's import and a
    model trained with torch.optim): predict's pass leaves those out, and nothing is leaked."""
    import gc
    import weakref

    import torch

    from autotune import predictor

    class Node:
        pass

    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(gc.get_freeze_count())
            return super().forward(x)

    cycle = Node()
    cycle.self = cycle
    ref = weakref.ref(cycle)
    run = predictor(Probe(4, 2), {"batch_size": 2}, device="cpu")
    seen.clear()  # building may call the model; the pass is what is checked
    out = run([torch.ones(4)] * 5)
    assert len(out) == 5
    assert seen and all(n > 0 for n in seen), seen  # frozen during the pass
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    del cycle
    gc.collect()
    assert ref() is None, "an object frozen during the pass was not given back to the collector"


def test_each_pass_of_the_tuned_loader_runs_with_earlier_objects_out_of_full_collections():
    """autotune.dataloader's passes get what predict's do; a pass left early gives them back."""
    import gc
    import pickle

    import torch

    from autotune import dataloader

    loader = dataloader([torch.zeros(3)] * 10, {"batch_size": 4})
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert [b.shape[0] for b in pickle.loads(pickle.dumps(loader))] == [4, 4, 2]  # a module-level class
    during = [gc.get_freeze_count() for _ in loader]
    assert len(during) == 3 and all(n > 0 for n in during)
    assert gc.get_freeze_count() == 0
    for _ in loader:
        break  # left after one batch: the iterator is dropped, its pass ends
    assert gc.get_freeze_count() == 0 and gc.isenabled()


INT8 = {"batch_size": 16, "quantization": "int8_dynamic"}


def test_predict_builds_a_costly_config_once_per_process_and_reuses_it():
    """An int8 (or compiled) config costs a build: predict's later calls with the same model,
    config and device reuse the first one's, as a predictor does."""
    built = []

    def make():
        built.append(1)
        return MLP()

    data = classification_data(40)
    first = autotune.predict(make, data, INT8, device="cpu")
    second = autotune.predict(make, data, INT8, device="cpu")
    run = autotune.predictor(make, INT8, device="cpu")
    assert len(built) == 1 and run.build_s == 0.0
    assert torch.equal(first.tensor, second.tensor)
    autotune.predict(make, data, {**INT8, "batch_size": 8}, device="cpu")  # another config: its own build
    assert len(built) == 2


def test_predict_called_again_on_the_same_samples_reuses_the_builds_loader_and_warm_up():
    """Each predict call makes a predictor: the build's last loader and warm-up are reused, not
    made again (they were a tenth of a pass of real MiniLM text); the same list grown gets its own."""
    collated = []

    def collate(batch):
        collated.append(len(batch))
        return torch.utils.data.default_collate(batch)

    config = {"batch_size": 8, "runtime": "torchscript"}  # traced: warmed per batch shape
    model, data = MLP(), classification_data(20)
    first = autotune.predict(model, data, config, collate_fn=collate, device="cpu")
    assert collated[-5:] == [8, 4, 8, 8, 4]  # the build's, a batch of each shape to warm up, the pass
    done = len(collated)
    second = autotune.predict(model, data, config, collate_fn=collate, device="cpu")
    assert collated[done:] == [8, 8, 4] and torch.equal(first.tensor, second.tensor)
    data.append(data[0])
    grown = autotune.predict(model, data, config, collate_fn=collate, device="cpu")
    # sample 20 now runs in a batch of 5, not 8: oneDNN's kernels for another batch shape may
    # round differently on another CPU, so the same sample agrees to float precision, not bitwise
    assert len(grown) == 21 and torch.allclose(grown.tensor[20], first.tensor[0], rtol=1e-5, atol=1e-6)


def test_predict_keeps_a_cheap_build_too():
    """Built on each call, the quickstart's winner (a copy of its MLP and a new loader for an
    epoch of 13 ms) ran predict() at 0.55 of apply + dataloader."""
    built = []

    def make():
        built.append(1)
        return MLP()

    data = classification_data(40)
    first = autotune.predict(make, data, {"batch_size": 8}, device="cpu")
    second = autotune.predict(make, data, {"batch_size": 8}, device="cpu")
    assert len(built) == 1 and torch.equal(first.tensor, second.tensor)


def test_a_model_changed_since_it_was_tuned_is_tuned_again_and_predict_says_so():
    import warnings

    model, data = MLP(), classification_data(24)
    before = autotune.predict(model, data, INT8, device="cpu")
    with torch.no_grad():
        model.net[0].weight.mul_(2.0)  # an in-place update, as an optimizer step makes
    with pytest.warns(UserWarning, match=r"^predict: `model` changed since this process tuned it") as caught:
        after = autotune.predict(model, data, INT8, device="cpu")
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert not torch.allclose(before.tensor, after.tensor)  # the new weights, not the old build
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unchanged since: the new build is reused, quietly
        again = autotune.predict(model, data, INT8, device="cpu")
    assert torch.equal(again.tensor, after.tensor)


def test_a_kept_build_goes_with_its_model():
    import gc

    from autotune.run import _built

    model = MLP()
    autotune.predict(model, classification_data(16), INT8, device="cpu")
    key = next(k for k in _built._BUILT if k[0] == id(model))
    del model
    gc.collect()
    assert key not in _built._BUILT


class _Pooled(torch.nn.Module):
    """Token embeddings averaged over the mask: cheap to compile, one graph per padded width."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(200, 8)

    def forward(self, input_ids, attention_mask):
        keep = attention_mask.unsqueeze(-1).float()
        return (self.embed(input_ids) * keep).sum(1) / keep.sum(1)


@pytest.mark.slow
def test_predict_called_twice_on_a_compiled_winner_compiles_once():
    """A compiled winner over trimmed, grouped text (one graph per width, weights frozen into
    each): the first predict builds it and compiles every width before its pass, the second
    compiles nothing (dynamo's own count), and a predictor of the same model reuses the build."""
    from torch._dynamo.utils import counters

    config = {"batch_size": 4, "padding": "trim", "length_grouping": 4, "compile_mode": "default-freezing"}
    model = _Pooled()
    data = [{"input_ids": torch.arange(1, n + 1), "attention_mask": torch.ones(n, dtype=torch.long)}
            for n in [3, 5, 7] * 8]  # fmt: skip
    torch._dynamo.reset()
    frames = counters["frames"]["ok"]
    first = autotune.predict(model, data, config, device="cpu")
    compiled = counters["frames"]["ok"] - frames
    assert compiled >= 2, compiled  # several widths, each its own graph
    second = autotune.predict(model, data, config, device="cpu")
    run = autotune.predictor(model, config, dataset=data, device="cpu")
    run(data)
    assert counters["frames"]["ok"] - frames == compiled and run.n_compiles == 0 and run.build_s == 0.0
    assert torch.equal(first.tensor, second.tensor)
    with torch.inference_mode():  # each sample's own output, in dataset order
        expected = torch.cat([_Pooled()(**{k: v[None] for k, v in s.items()}) for s in data[:3]])
    torch.testing.assert_close(first.tensor[:3], expected)


@pytest.mark.slow
def test_a_predictor_warms_every_width_the_tuned_loader_makes_before_its_first_call():
    from torch._dynamo.utils import counters

    config = {"batch_size": 2, "padding": "trim", "length_grouping": 4, "compile_mode": "default"}
    data = [{"input_ids": torch.arange(1, n + 1), "attention_mask": torch.ones(n, dtype=torch.long)}
            for n in [2, 4, 6, 8] * 4]  # fmt: skip
    torch._dynamo.reset()
    run = autotune.predictor(_Pooled(), config, dataset=data, device="cpu")
    assert run.compile_s > 0 and run.build_s > 0
    frames = counters["frames"]["ok"]
    run(data)
    assert counters["frames"]["ok"] == frames and run.n_compiles == 0


def test_a_predictor_of_an_openvino_config_warms_every_batch_shape_before_its_first_call():
    """OpenVINO's CPU plugin prepares its kernels for each new input shape, and a trial warms each
    shape before its timed windows: a predictor of an OpenVINO config runs one batch of each
    width the tuned loader makes before its first call too, and its outputs are predict's."""
    pytest.importorskip("openvino", reason="runtime=openvino needs the openvino extra")
    config = {"batch_size": 4, "padding": "trim", "length_grouping": 4, "runtime": "openvino"}
    data = [{"input_ids": torch.arange(1, n + 1), "attention_mask": torch.ones(n, dtype=torch.long)}
            for n in [3, 5, 7] * 4]  # fmt: skip
    model = _Pooled()
    run = autotune.predictor(model, config, dataset=data, device="cpu")
    assert run.compile_s > 0  # the warm-up ran, before any call
    out = run(data)
    torch.testing.assert_close(out.tensor, autotune.predict(model, data, config, device="cpu").tensor)
    with torch.inference_mode():  # each sample's own output, in dataset order
        expected = torch.cat([_Pooled()(**{k: v[None] for k, v in s.items()}) for s in data])
    torch.testing.assert_close(out.tensor, expected, rtol=1e-4, atol=1e-5)
