"""``runtime=torchscript``: the tuned model traced, frozen and optimized for inference by
:mod:`autotune.export.torchscript`, run as a TorchScript module; its artifact is ``model.pt``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.runtimes.base import Runtime, register

__all__ = ["TorchScript"]


@register
class TorchScript(Runtime):
    name = "torchscript"
    format = "torchscript"
    file_name = "model.pt"
    order = 10
    load_rank = 10
    compiles_per_shape = True
    fixed_batch = True
    help = "a frozen TorchScript trace"

    def build(self, state: Any, extras: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
        import torch

        from autotune.export.torchscript import ScriptRunner, export_torchscript

        # Traced on the model's own device: a CPU example cannot run a CUDA model.
        info = export_torchscript(state.model, extras.example_on(state.device), folder / self.file_name)
        script = torch.jit.load(str(folder / self.file_name), map_location=state.device)
        state.artifact = {"format": self.format, **info, "path": str(folder / self.file_name)}
        return ScriptRunner(script, info["input_names"]), info

    def export(
        self, model: Any, example: Any, path: Path, *, device: str, fallback: Any, source: Any, spatial: bool
    ) -> tuple[dict[str, Any], Callable[..., Any]]:
        import torch

        from autotune.export.torchscript import export_torchscript, positional_inputs

        info = export_torchscript(model, example, path, fallback=fallback)
        loaded = torch.jit.load(str(path))  # the saved file is what ships, so it is what is checked

        def run(*args: Any, **kwargs: Any) -> Any:
            return loaded(*positional_inputs(info["input_names"], args, kwargs))

        return info, run

    def open_file(self, path: Path, artifact: dict[str, Any]) -> Any:
        import torch

        from autotune.export.torchscript import ScriptRunner

        return ScriptRunner(torch.jit.load(str(path)), artifact["input_names"])

    def open(self, path: Path, record: dict[str, Any], device: str) -> Any:
        import torch

        return torch.jit.load(str(path), map_location=device)
