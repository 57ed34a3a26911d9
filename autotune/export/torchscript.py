"""TorchScript artifacts: trace, freeze, optimize for inference, save.

The artifact takes its inputs positionally in the order of ``input_names``, and by keyword too
when the model's ``forward`` names them. ``torch.jit.optimize_for_inference`` specializes the
graph to the device it is traced on (oneDNN layouts on CPU): load it on that device type.
"""

from __future__ import annotations

import inspect
import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.errors import ExportError
from autotune.export.parity import describe_error, exportable, output_leaves, quiet_warnings
from autotune.samples import model_inputs

__all__ = ["export_torchscript", "positional_inputs"]

_CHECK_RTOL = 1e-4


class _Positional(nn.Module):
    """A model whose keyword inputs its ``forward`` does not name (``**kwargs``) behind a
    positional signature, which the tracer can follow."""

    def __init__(self, model: nn.Module, n_args: int, keys: list[str]) -> None:
        super().__init__()
        self.model = model
        self.n_args = n_args
        self.keys = keys

    def forward(self, *flat: torch.Tensor) -> Any:
        return self.model(*flat[: self.n_args], **dict(zip(self.keys, flat[self.n_args :], strict=True)))


def positional_inputs(input_names: list[str], args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """Model inputs in the positional order a TorchScript artifact takes them."""
    return [*args, *(kwargs[name] for name in input_names[len(args) :])]


def _named_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``kwargs`` in ``forward``'s parameter order when it names every one, else ``None``."""
    try:
        bound = inspect.signature(model.forward).bind(**kwargs)
    except (TypeError, ValueError):
        return None
    params = inspect.signature(model.forward).parameters
    if any(params[name].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for name in bound.arguments):
        return None
    return dict(bound.arguments)


def _trace(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, list[str]]:
    """Trace ``model``; return the traced module and its inputs' names in positional order."""
    with torch.no_grad(), quiet_warnings():
        # strict=False: dict and list outputs are traced as they are.
        if not kwargs:
            traced = torch.jit.trace(model, tuple(args), strict=False, check_trace=False)
            return traced, [f"input_{i}" for i in range(len(args))]
        named = _named_kwargs(model, kwargs)
        if named is not None:
            traced = torch.jit.trace(model, example_kwarg_inputs=named, strict=False, check_trace=False)
            return traced, list(named)
        wrapper = _Positional(model, len(args), list(kwargs))
        traced = torch.jit.trace(wrapper, (*args, *kwargs.values()), strict=False, check_trace=False)
        return traced, [f"input_{i}" for i in range(len(args))] + list(kwargs)


def _same(out: Any, expected: list[torch.Tensor]) -> bool:
    got = output_leaves(out)
    return len(got) == len(expected) and all(
        g.shape == e.shape
        and torch.allclose(g.float(), e.float(), rtol=_CHECK_RTOL, atol=_CHECK_RTOL * max(1.0, float(e.abs().max())))
        for g, e in zip(got, expected, strict=True)
        if e.numel()
    )


def _reloaded(module: Any) -> tuple[Any, bytes]:
    """``module`` saved and loaded again (what the artifact's user gets), and the bytes saved."""
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    data = buffer.getvalue()
    return torch.jit.load(io.BytesIO(data)), data


def _optimize(traced: Any, inputs: list[Any]) -> tuple[Any, bool, bool, bytes | None]:
    """Freeze and optimize ``traced`` where the result still saves, loads and gives the same
    outputs: (module, frozen, optimized, the bytes of the module that was loaded and checked,
    or ``None`` where nothing was).

    ``optimize_for_inference`` on CPU can embed oneDNN weight constants that save but fail to
    load again; hence the round trip. Its bytes are what the file holds, and the frozen module
    it loaded is what ``optimize_for_inference`` changes in place: each was saved and loaded
    once more (a second of real MiniLM's 90-MB module).
    """
    module, frozen, optimized, data = traced, False, False, None
    with torch.no_grad(), quiet_warnings():
        expected = output_leaves(traced(*inputs))
        copy = None  # a loaded copy of ``module``, for optimize_for_inference to change
        try:
            candidate = torch.jit.freeze(traced.eval())
            loaded, saved = _reloaded(candidate)
            if _same(loaded(*inputs), expected):
                module, frozen, data, copy = candidate, True, saved, loaded
        except Exception:  # freezing is an optimization; the traced module is a valid artifact
            pass
        try:
            candidate = torch.jit.optimize_for_inference(copy if copy is not None else _reloaded(module)[0])
            loaded, saved = _reloaded(candidate)
            if _same(loaded(*inputs), expected):
                module, optimized, data = candidate, True, saved
        except Exception:  # likewise
            pass
    return module, frozen or optimized, optimized, data  # optimize_for_inference freezes too


def _trace_either(
    model: nn.Module, fallback: nn.Module | None, args: tuple, kwargs: dict
) -> tuple[Any, list, str | None]:
    """Trace ``model``, else ``fallback``: (traced, input names, why the fallback was used)."""
    try:
        return (*_trace(exportable(model), args, kwargs), None)
    except Exception as exc:  # quantized tensor subclasses, PT2E graphs, data-dependent code...
        error = describe_error(exc)
        if fallback is None:
            raise ExportError(
                f"torch.jit.trace failed on {type(model).__name__}: {error}. Pass `fallback=` an exportable "
                "form of the model (the unquantized one, say) to export that instead."
            ) from exc
    try:
        return (*_trace(exportable(fallback), args, kwargs), f"tracing the tuned model failed: {error}")
    except Exception as exc:
        raise ExportError(
            f"torch.jit.trace failed on the tuned model ({error}) and on the fallback ({describe_error(exc)})."
        ) from exc


def export_torchscript(
    model: nn.Module, example: Any, path: Path, *, fallback: nn.Module | None = None
) -> dict[str, Any]:
    """Trace ``model`` on ``example``, freeze and optimize it where that works, and save it.

    Args:
        model: The (tuned) model, in eval mode, on the device the artifact will run on.
        example: One collated batch on the model's device.
        path: The ``.pt`` file to write (``torch.jit.load`` reads it).
        fallback: The nearest exportable form of ``model`` (the unquantized pruned model, say),
            traced when ``model`` cannot be.

    Returns:
        ``{"path", "form", "frozen", "optimized", "reason", "input_names"}``: ``form`` is
        ``"tuned"`` or ``"fallback"`` (``reason`` says why), ``frozen`` and ``optimized`` say
        whether ``torch.jit.freeze`` and ``torch.jit.optimize_for_inference`` applied, and
        ``input_names`` is the order the artifact takes its inputs positionally.

    Raises:
        ExportError: neither ``model`` nor ``fallback`` could be traced, or saving failed.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp()) / "model.pt"
        >>> export_torchscript(nn.Linear(4, 2).eval(), torch.randn(2, 4), out)["form"]
        'tuned'
    """
    args, kwargs = model_inputs(example)
    traced, names, reason = _trace_either(model, fallback, args, kwargs)
    module, frozen, optimized, data = _optimize(traced, positional_inputs(names, args, kwargs))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if data is not None:  # the bytes that were loaded again and checked
            path.write_bytes(data)
        else:
            torch.jit.save(module, str(path))
    except Exception as exc:
        raise ExportError(f"Could not save the TorchScript module to {str(path)!r}: {describe_error(exc)}") from exc
    return {
        "path": str(path),
        "form": "tuned" if reason is None else "fallback",
        "frozen": frozen,
        "optimized": optimized,
        "reason": reason,
        "input_names": names,
    }


class ScriptRunner(nn.Module):
    """A loaded TorchScript artifact called like the original model (keyword inputs too):
    what the ``runtime=torchscript`` candidate runs."""

    def __init__(self, script: Any, input_names: list[str]) -> None:
        super().__init__()
        self.script = script
        self.input_names = list(input_names)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.script(*positional_inputs(self.input_names, args, kwargs))
