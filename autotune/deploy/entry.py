"""``autotune.load``: :func:`autotune.deploy.serve.load`, but for an artifact whose runtime runs it
without torch (``runs_without_torch``: OpenVINO's IR): ``load(out, format="openvino")`` serves it
without importing torch, and so does ``load(out)`` on a machine without torch (a deployment image
with ``openvino`` only), where it is the one artifact that can run. Everything else is served,
timing the candidates, as before.

Example:
    >>> predict = autotune.load("autotune_out", format="openvino")  # doctest: +SKIP
    >>> predict(batch)  # numpy in, numpy out  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["load"]


def load(
    out_dir: str | Path,
    *,
    model: Any = None,
    dataset: Any = None,
    collate_fn: Any = None,
    format: str | None = None,
    device: str | None = None,
    allow_modified: bool = False,
) -> Any:
    """Serve a tuning run from ``out_dir``: see :func:`autotune.deploy.serve.load`, which this is.

    Two cases run without torch, and import none: ``format`` of a runtime that runs its file
    without torch (``format="openvino"``: the IR, untimed, on the CPU), and no ``format`` on a
    machine where torch is not installed, which serves the run's artifact of such a runtime, the
    one that runs there.

    Raises:
        ConfigError: as :func:`autotune.deploy.serve.load`; and without torch, a run with no
            OpenVINO artifact, or ``device`` other than the CPU for one.
    """
    if model is None and _light(format):
        from autotune.deploy.light import open_light

        return open_light(Path(out_dir), format, device, allow_modified)
    from autotune.deploy.serve import load as serve

    return serve(
        out_dir,
        model=model,
        dataset=dataset,
        collate_fn=collate_fn,
        format=format,
        device=device,
        allow_modified=allow_modified,
    )


def _light(fmt: str | None) -> bool:
    """Whether ``fmt`` is served without torch: its runtime runs its file so, or no format is
    named where torch is not installed."""
    if fmt is None:
        return _torch_missing()
    from autotune.runtimes.base import of_format

    runtime = of_format(fmt)
    return runtime is not None and runtime.runs_without_torch


def _torch_missing() -> bool:
    try:
        return importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):  # a broken entry in sys.modules
        return True
