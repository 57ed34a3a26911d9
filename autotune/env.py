"""What this machine can run: device, precisions, compiler, cores, versions.

The :class:`Env` is detected once per study in the parent process and written, as its
manifest, with every result, so a result always says where it was measured.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import sys
from typing import Any

from .errors import ConfigError

__all__ = ["Env", "resolve_device"]


def resolve_device(device: str) -> str:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a concrete device string.

    Raises:
        ConfigError: the name is not a device, or CUDA was asked for where there is none.
    """
    import torch

    if not isinstance(device, str):
        raise ConfigError(f"`device` must be 'auto', 'cpu', 'cuda' or 'cuda:N', but got {device!r}.")
    name = device.strip().lower()
    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"`device` is {device!r}, but CUDA is not available here "
                f"(torch {torch.__version__}). Use device='cpu' or 'auto'."
            )
        index = 0 if name == "cuda" else name.split(":", 1)[1]
        if not str(index).isdigit() or int(index) >= torch.cuda.device_count():
            raise ConfigError(
                f"`device` is {device!r}, but this machine has {torch.cuda.device_count()} "
                "CUDA device(s). Use 'cuda:0' up to the last index."
            )
        return f"cuda:{int(index)}"
    raise ConfigError(f"`device` must be 'auto', 'cpu', 'cuda' or 'cuda:N', but got {device!r}.")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _mem_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing or unsupported platform
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclasses.dataclass(frozen=True)
class Env:
    """Hardware and software facts that decide which knob values can run.

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        gpu_name: The GPU's name, ``None`` on CPU.
        gpu_capability: Compute capability as ``(major, minor)``, ``None`` on CPU.
        device_mem_bytes: Memory of the device the model runs on (GPU memory or RAM).
        bf16: bfloat16 autocast is supported and fast on this device.
        fp16: float16 autocast is supported on this device.
        cpu_threads: torch's default intra-op thread count (physical cores).
        cpu_capability: The vector instruction set torch dispatches to (``AVX512``, ``AVX2``...).
        compiler: What ``torch.compile`` needs here (a C++ compiler on CPU, Triton on CUDA),
            or ``None`` when it is missing.
        versions: Python, torch, optuna, numpy, CUDA and cuDNN versions.
    """

    device: str
    gpu_name: str | None
    gpu_capability: tuple[int, int] | None
    device_mem_bytes: int
    bf16: bool
    fp16: bool
    cpu_threads: int
    cpu_capability: str
    compiler: str | None
    versions: dict[str, str | None]

    @property
    def is_cuda(self) -> bool:
        """Whether trials run on a CUDA device."""
        return self.device.startswith("cuda")

    @classmethod
    def detect(cls, device: str = "auto") -> Env:
        """Detect the facts for ``device`` on this machine.

        Example:
            >>> Env.detect("cpu").device
            'cpu'
        """
        import numpy
        import optuna
        import torch

        device = resolve_device(device)
        flags = _cpu_flags()
        cpu_capability = torch.backends.cpu.get_cpu_capability()
        versions: dict[str, str | None] = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "optuna": optuna.__version__,
            "numpy": numpy.__version__,
            "cuda": torch.version.cuda,
            "cudnn": None,
        }
        if device.startswith("cuda"):
            index = int(device.split(":")[1])
            props = torch.cuda.get_device_properties(index)
            versions["cudnn"] = str(torch.backends.cudnn.version())
            try:
                import triton  # noqa: F401

                compiler: str | None = "triton"
            except ImportError:
                compiler = None
            return cls(
                device=device,
                gpu_name=props.name,
                gpu_capability=(props.major, props.minor),
                device_mem_bytes=int(props.total_memory),
                bf16=bool(torch.cuda.is_bf16_supported()),
                fp16=True,
                cpu_threads=torch.get_num_threads(),
                cpu_capability=cpu_capability,
                compiler=compiler,
                versions=versions,
            )
        # bf16 autocast runs on any CPU, but is only worth trying where oneDNN has native
        # bf16 (AVX512-BF16, AMX) or at least AVX-512 to emulate it at reasonable speed.
        bf16 = bool(flags & {"avx512_bf16", "amx_bf16"}) or cpu_capability.startswith("AVX512")
        compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
        return cls(
            device="cpu",
            gpu_name=None,
            gpu_capability=None,
            device_mem_bytes=_mem_bytes(),
            bf16=bf16,
            fp16=False,
            cpu_threads=torch.get_num_threads(),
            cpu_capability=cpu_capability,
            compiler=compiler,
            versions=versions,
        )

    def manifest(self) -> dict[str, Any]:
        """The JSON-safe description written with every result."""
        data = dataclasses.asdict(self)
        data["gpu_capability"] = list(self.gpu_capability) if self.gpu_capability else None
        data["platform"] = platform.platform()
        data["machine"] = platform.machine()
        data["executable"] = sys.executable
        data["cpu_count"] = os.cpu_count()
        return data

    def hardware_key(self) -> str:
        """A short name of the hardware, used to compare only like with like."""
        if self.is_cuda:
            return f"{self.gpu_name} (sm{self.gpu_capability[0]}{self.gpu_capability[1]})"
        return f"cpu {platform.machine()} {self.cpu_capability} x{self.cpu_threads}"
