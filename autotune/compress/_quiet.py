"""Third-party imports without their import-time noise.

Importing torchao logs a line for each optional kernel library its build cannot load here (the
CUDA ``_C_mxfp8`` and ``_C_cutlass_90a`` extensions on a CPU machine, for one; autotune's int8
paths use none of them) and, through torch, a deprecation about how it registers an enum with
pytree; its PT2E quantizers, torch's deprecation of TorchScript methods. Every run that tried
an int8 method printed them. They are dropped by message while torchao is imported; anything
else torchao or torch logs or warns, and every warning of autotune's own, still shows.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

__all__ = ["quiet_torchao"]

# (logger, text in the message) of each known import-time message.
_TORCHAO_NOISE = (
    ("torchao", "Failed to load "),  # an optional kernel library this build or machine lacks
    ("torchao", "Skipping import of cpp extensions"),  # the same, for a torch it was not built for
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


class _Drop(logging.Filter):
    """Drops the records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """Within it, torchao's known import-time messages are dropped; nothing else is."""
    added = [(logging.getLogger(name), _Drop(text)) for name, text in _TORCHAO_NOISE]
    for logger, drop in added:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            # torchao's PT2E quantizers define TorchScript methods, which torch now deprecates.
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is ", module="torch")
            yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)
