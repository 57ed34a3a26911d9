"""torchao's int8 paths import it without its import-time noise, and hide nothing else."""

import logging
import platform
import subprocess
import sys
import textwrap
import warnings

import pytest

pytest.importorskip("torchao")

SCRIPT = """
import warnings
import torch
from torch import nn
from autotune.compress.quantize import quantize

data = [torch.randn(4, 8) for _ in range(2)]
for method in {methods}:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    quantize(model, method, "cpu", data, example=data[0])
warnings.warn("autotune's own warning")
"""


def test_int8_paths_print_nothing_but_autotune_warnings():
    methods = ["int8_weight_only"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        methods.append("int8_static")  # PT2E: the x86 quantizer's imports
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT.format(methods=methods))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    # The one line left is the script's own warning: torchao's lines are gone, warnings are not off.
    assert len(lines) == 1 and lines[0].endswith("UserWarning: autotune's own warning"), done.stderr


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_quiet_context_drops_only_the_known_messages():
    from autotune.compress._quiet import quiet_torchao

    torchao_log, pytree_log = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    seen = _Records()  # on the loggers themselves: torch's own logger does not propagate to the root
    for log in (torchao_log, pytree_log):
        log.addHandler(seen)
    try:
        with quiet_torchao(), pytest.warns(UserWarning, match="still shows"):
            torchao_log.warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
            pytree_log.warning("<enum 'K'> is an Enum subclass and is now natively supported by torch.compile")
            torchao_log.warning("another torchao message")
            pytree_log.warning("another pytree message")
            warnings.warn("an autotune warning still shows", UserWarning, stacklevel=1)
        torchao_log.warning("Failed to load /x/_C_mxfp8.so: after the import, not dropped")
    finally:
        for log in (torchao_log, pytree_log):
            log.removeHandler(seen)
    assert seen.messages == [
        "another torchao message",
        "another pytree message",
        "Failed to load /x/_C_mxfp8.so: after the import, not dropped",
    ]
