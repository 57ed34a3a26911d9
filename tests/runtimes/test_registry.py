"""A runtime is one registered class: a runtime defined here, in the test alone, is offered by
the ``runtime`` knob, validated as a configuration's value, built by ``apply`` and measured by a
search, and the registry forgets it afterwards. No other module names it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import autotune
from autotune.config import Config
from autotune.data import describe
from autotune.errors import ConfigError
from autotune.knobs import SpaceContext, get_knob
from autotune.record import trial_record
from autotune.runtimes.base import REGISTRY, Runtime, doctor_row, formats, get_runtime, names, register
from tests.models import MLP, classification_data


class Traced(Runtime):
    """The tuned model run as its ``torch.jit.trace``, saved to ``model.traced.pt`` and read back."""

    name = "traced"
    format = "traced"
    file_name = "model.traced.pt"
    help = "a plain trace"
    built: list[Path] = []  # the files its builds wrote

    def build(self, state: Any, extras: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
        from autotune.samples import model_inputs

        path = folder / self.file_name
        args, _ = model_inputs(extras.example_on(state.device))  # the model's positional inputs
        torch.jit.save(torch.jit.trace(state.model, tuple(args), check_trace=False), str(path))
        self.built.append(path)
        state.artifact = {"format": self.format, "path": str(path), "input_names": ["x"]}
        return torch.jit.load(str(path)), {"bytes": path.stat().st_size}


@contextlib.contextmanager
def registered(cls: type[Runtime]) -> Iterator[Runtime]:
    """``cls`` in the registry while the block runs, and gone after it, whatever happens."""
    register(cls)
    try:
        yield REGISTRY[cls.name]
    finally:
        REGISTRY.pop(cls.name, None)
        Traced.built.clear()


@pytest.fixture
def traced() -> Iterator[Runtime]:
    with registered(Traced) as runtime:
        yield runtime


def test_the_knob_offers_a_registered_runtime_and_validates_it(traced, cpu_env):
    knob = get_knob("runtime")
    assert knob.choices[0] == "torch" and knob.choices[-1] == "traced"
    assert "traced" in knob.offer(SpaceContext(cpu_env, describe([torch.zeros(4)]), 32)).values
    assert Config({"runtime": "traced"})["runtime"] == "traced"
    assert knob.parse("traced") == "traced" and "a plain trace" in knob.help
    assert get_runtime("traced") is traced and "traced" in formats()


def test_apply_builds_through_a_registered_runtime(traced):
    model, data = MLP().eval(), classification_data(32)
    fast = autotune.apply(model, {"runtime": "traced", "batch_size": 8}, dataset=data, device="cpu")
    assert len(traced.built) == 1 and traced.built[0].name == "model.traced.pt"
    batch = torch.stack([x for x, _ in data[:8]])
    with torch.no_grad():
        torch.testing.assert_close(fast(batch), model(batch))


def test_a_search_measures_a_registered_runtime(traced, tmp_path):
    result = autotune.optimize(
        MLP(),
        classification_data(64),
        space={"base": None, "batch_size": [8, 16]},
        fix={"runtime": "traced"},
        baseline_batch_size=8,
        measure={"n_windows": 2, "window_s": 0.02, "warmup_batches": 1, "n_remeasure": 0},
        n_trials=2,  # the baseline (torch), then a candidate with the runtime fixed
        n_finalists=0,
        device="cpu",
        isolation="inprocess",
        out_dir=tmp_path,
        export=(),
        profile=False,
        progress=False,
    )
    records = [trial_record(t) for t in result.study.trials]
    measured = [r for r in records if (r.get("config") or {}).get("runtime") == "traced"]
    assert traced.built and measured, records
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in measured), measured


def test_the_registry_forgets_a_runtime_registered_in_a_test():
    with registered(Traced):
        assert "traced" in names()
        with pytest.raises(ConfigError, match="registered already"):
            register(Traced)
    assert "traced" not in names() and "traced" not in get_knob("runtime").choices
    with pytest.raises(ConfigError, match="Known values"):
        Config({"runtime": "traced"})
    with pytest.raises(ConfigError, match=r"No runtime named 'traced'\. Known: torch, torchscript"):
        get_runtime("traced")


class Checked(Traced):
    """The trace again, with a section of its own in ``autotune doctor``."""

    name = "checked"
    format = "checked"
    file_name = "model.checked.pt"

    def doctor_facts(self, on_cuda: bool) -> dict[str, Any]:
        return {"version": "1.0"}

    def doctor_checks(self, facts: dict[str, Any]) -> list[dict[str, Any]]:
        return [doctor_row("checked", "ok", f"{facts[self.name]['version']}: runtime=checked is offered")]


def test_a_registered_runtime_has_its_doctor_section_and_is_an_export_format():
    """The doctor gathers and prints a registered runtime's section under its name, and
    ``optimize(export=...)`` takes its format, as long as it is registered."""
    from rich.console import Console

    from autotune.cli import _print_checks
    from autotune.doctor.core import diagnose, gather
    from autotune.run.options import Options

    with registered(Checked):
        facts = gather(".")
        assert facts["checked"] == {"version": "1.0"}
        checks = diagnose(facts)
        assert [(c.name, c.status) for c in checks if c.section == "checked"] == [("checked", "ok")]
        console = Console(record=True, width=250, color_system=None)
        _print_checks(console, checks)
        assert "1.0: runtime=checked is offered" in console.export_text()
        assert Options(export=["checked"]).export == ("checked",)
    assert not [c for c in diagnose(facts) if c.section == "checked"]  # gone with it
    with pytest.raises(ConfigError, match="No export format named 'checked'"):
        Options(export=["checked"])


class _Recording(torch.nn.Module):
    """The trace, timing each of its calls into a Chrome trace while ``path`` is set."""

    def __init__(self, traced: Any) -> None:
        super().__init__()
        self.traced, self.path, self.events = traced, None, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        begun = time.perf_counter()
        out = self.traced(x)
        if self.path is not None:
            self.events.append({"name": "forward", "cat": "Node", "ts": begun * 1e6,
                                "dur": (time.perf_counter() - begun) * 1e6})  # fmt: skip
        return out


class Profiled(Traced):
    """The trace again, recording its own calls where the profile asks its runtime to."""

    name = "profiled"
    format = "profiled"
    file_name = "model.profiled.pt"

    def build(self, state: Any, extras: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
        traced, info = super().build(state, extras, folder)
        return _Recording(traced), info

    def profiling(self, model: Any, scratch: Path) -> list[Any]:
        sessions = [m for m in model.modules() if isinstance(m, _Recording)]
        for m in sessions:
            m.path, m.events = scratch / "profiled.json", []
        return sessions

    def profiled(self, sessions: list[Any], n_active: int) -> tuple[list[dict[str, Any]], list[str]]:
        import json

        rows, files = [], []
        for m in sessions:
            m.path.write_text(json.dumps(m.events))
            files.append(str(m.path))
            rows.append({"name": "profiled::forward", "self_us": sum(e["dur"] for e in m.events),
                         "calls": len(m.events), "input_shapes": ""})  # fmt: skip
        return rows, files

    def unprofile(self, sessions: list[Any]) -> None:
        for m in sessions:
            m.path = None


def test_a_registered_runtime_profiles_its_own_sessions(tmp_path):
    """The profile of a candidate asks every registered runtime for the sessions the PyTorch
    profiler cannot see into: their rows are the operators, their trace ships beside PyTorch's."""
    import gzip
    import json

    from autotune.knobs.state import BuildExtras
    from autotune.trial.build import build
    from autotune.trial.profile import profile_state

    data = classification_data(64)
    with registered(Profiled):
        extras = BuildExtras(example=torch.utils.data.default_collate(data[:4]))
        state = build(MLP(), Config({"batch_size": 16, "runtime": "profiled"}), "cpu", extras=extras)
        summary = profile_state(state, data, tmp_path / "trace-best.json.gz")
    assert summary["runtime"] == "profiled" and summary["runtime_trace"] == "trace-best-profiled.json.gz"
    assert [o for o in summary["operators"] if o["name"] == "profiled::forward"]
    with gzip.open(tmp_path / summary["runtime_trace"], "rt") as f:
        assert json.load(f)[0]["name"] == "forward"
    assert all(m.path is None for m in state.model.modules() if isinstance(m, _Recording))  # set back
