import shutil

import pytest
import torch

import autotune
from autotune.data import describe
from autotune.knobs import SpaceContext, get_knob
from tests.models import TinyCNN


def test_cuda_graph_modes_are_not_offered_on_cpu(cpu_env):
    offer = get_knob("compile_mode").offer(SpaceContext(cpu_env, describe([torch.zeros(4)]), 32))
    assert "reduce-overhead" not in offer.values and "max-autotune" not in offer.values
    assert "CUDA graphs" in offer.excluded["reduce-overhead"]
    assert ("default" in offer.values) == (cpu_env.compiler is not None)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")
def test_compiled_model_matches_eager():
    model = TinyCNN().eval()
    x = torch.randn(4, 3, 8, 8)
    tuned = autotune.apply(model, {"compile_mode": "default"}, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), model(x), atol=1e-4, rtol=1e-4)
    assert hasattr(tuned, "_orig_mod")  # really compiled


class _Scaled(torch.nn.Module):
    """Python floats the forward reads: a LayerNorm's eps and a scale kept as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm, self.scale = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.scale


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")
def test_a_compile_with_symbolic_shapes_traces_the_model_once():
    """With ``dynamic=True`` torch makes a model's Python floats symbols, fails to make them
    tensors and traces the whole model again: 12-16 s more of every compile of real MiniLM."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    before = dynamo_config.specialize_float
    model = _Scaled().eval()
    tuned = autotune.apply(model, {"compile_mode": "default", "compile_dynamic": True}, device="cpu")
    with torch.no_grad():
        for shape in [(4, 7, 16), (3, 5, 16), (2, 9, 16)]:  # other batch sizes and lengths: no recompile
            x = torch.randn(*shape)
            torch.testing.assert_close(tuned(x), model(x), atol=1e-5, rtol=1e-5)
    assert counters["aot_autograd"]["total"] == 1  # one trace, one graph for every shape
    assert isinstance(autotune.knobs.state.unwrap(tuned), _Scaled)  # under the wrappers, for exporters
    assert dynamo_config.specialize_float == before  # set around the model's calls only


@pytest.mark.gpu
def test_cuda_graph_modes_run_on_cuda():
    model = TinyCNN().eval()
    x = torch.randn(4, 3, 8, 8, device="cuda")
    tuned = autotune.apply(model, {"compile_mode": "reduce-overhead"}, device="cuda")
    with torch.no_grad():
        for _ in range(3):  # warm-up runs record the CUDA graph
            out = tuned(x)
        torch.testing.assert_close(out, model.cuda()(x), atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")
@pytest.mark.parametrize("first", ["default", "default-freezing"])
def test_each_compile_variant_built_in_one_worker_runs_its_own_graph(monkeypatch, first):
    """dynamo's cache ignores inductor's freezing flag: built side by side in one worker (a
    selection's rounds), ``default-freezing`` ran the graph ``default`` compiled first, unfrozen."""
    import torch._inductor.freezing as freezing
    from torch._dynamo.utils import counters

    from autotune.config import Config
    from autotune.trial.inference import TrialContext
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.spec import WorkerSpec
    from tests.models import MLP, classification_data

    frozen: list[int] = []
    freeze = freezing.freeze  # counted, and run: inductor imports it where it freezes a graph
    monkeypatch.setattr(freezing, "freeze", lambda *a, **k: frozen.append(1) or freeze(*a, **k))
    spec = WorkerSpec(
        model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
        baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
        measure=MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1, n_remeasure=0),
    )  # fmt: skip
    ctx = TrialContext(spec)
    modes = [first, "default" if first != "default" else "default-freezing"]
    states = ctx.prepare([dict(Config({"batch_size": 8, "compile_mode": m})) for m in modes])
    x = torch.stack([s[0] for s in classification_data(8)])
    with torch.no_grad():
        for mode, state in zip(modes, states, strict=True):
            n_frozen, n_graphs = len(frozen), counters["stats"]["unique_graphs"]
            state.model(x)
            assert counters["stats"]["unique_graphs"] > n_graphs, f"{mode} ran a graph compiled for the other"
            assert len(frozen) - n_frozen == (mode == "default-freezing"), mode
