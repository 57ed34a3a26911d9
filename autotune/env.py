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

from autotune.errors import ConfigError

__all__ = [
    "Env", "c_compiler", "cpu_info", "cxx_compiler", "nvidia_driver", "resolve_device", "usable_cpus", "use_device",
]  # fmt: skip

# CPU flags (as /proc/cpuinfo names them) that decide which precisions pay off on a CPU.
ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def use_device(device: str) -> None:
    """Make ``device`` this process's current CUDA device, where it is one.

    CUDA events, streams and graphs made without a device are the current device's: with the
    model on ``cuda:1`` and the current device 0, a timing event records on device 0's stream,
    reads about 0 ms, and the host's launches look like the bottleneck. A worker measuring on
    ``cuda:N`` calls this first.

    Example:
        >>> use_device("cpu")  # nothing to do off CUDA
    """
    if not device.startswith("cuda"):
        return
    import torch

    torch.cuda.set_device(torch.device(device))


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


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``, else the platform's), ``None`` where neither says."""
    return _cpuinfo_field("model name") or platform.processor() or None


def _physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unsupported platform
        return None


def _cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """Cores granted by a cgroup CPU quota (a container's ``--cpus``), or ``None`` without one.

    Args:
        root: Where the cgroup filesystem is mounted: ``cpu.max`` there (cgroup v2), else
            ``cpu/cpu.cfs_quota_us`` and ``cpu/cpu.cfs_period_us`` (cgroup v1).
    """
    try:  # cgroup v2: "max 100000" or "200000 100000"
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def _affinity_cpus() -> int:
    """CPUs this process may be scheduled on (its affinity), else every logical CPU."""
    try:
        return len(os.sched_getaffinity(0)) or os.cpu_count() or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process can keep busy at once: its CPU affinity, capped by a cgroup CPU quota
    (rounded down: 1.5 CPUs of quota keep one busy, the other half is shared), at least 1.

    ``os.cpu_count()`` counts the machine's CPUs, which a container or ``taskset`` may not give
    this process; loader workers past this count only take turns on the same CPUs.

    Args:
        cgroup_root: Where the cgroup filesystem is mounted (see :func:`_cpu_quota`).

    Example:
        >>> 1 <= usable_cpus() <= (os.cpu_count() or 1)
        True
    """
    cpus = _affinity_cpus()
    quota = _cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, int(quota))
    return max(1, cpus)


def cpu_info() -> dict[str, Any]:
    """The CPU's model, cores and the instruction-set extensions that decide precisions.

    Returns:
        ``model`` (``None`` where the OS does not say), ``machine``, ``logical_cores``,
        ``physical_cores`` (``None`` when unknown), ``usable_cores`` (this process's CPU
        affinity), ``quota_cores`` (a cgroup CPU quota, ``None`` without one) and ``isa``: the
        flags of :data:`ISA_FLAGS` this CPU has.

    Example:
        >>> cpu_info()["logical_cores"] >= 1
        True
    """
    logical = os.cpu_count() or 1
    usable = _affinity_cpus()
    flags = _cpu_flags()
    return {
        "model": cpu_model(),
        "machine": platform.machine(),
        "logical_cores": logical,
        "physical_cores": _physical_cores(),
        "usable_cores": usable,
        "quota_cores": _cpu_quota(),
        "isa": [f for f in ISA_FLAGS if f in flags],
    }


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU (``$CXX``, else ``g++`` or ``c++`` on PATH)."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def c_compiler() -> str | None:
    """The C compiler Triton builds its launcher with (``$CC``, else ``cc``, ``gcc`` or ``clang``)."""
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    for name in (*names, "cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _libcuda_version() -> str | None:
    """The CUDA version the driver supports, from ``cuDriverGetVersion`` (no CUDA context needed)."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    return None


def _nvidia_smi() -> tuple[str | None, str | None, int]:
    """(driver version, CUDA version, GPU count) as nvidia-smi prints them."""
    import re
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None, 0
    try:
        text = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
        listing = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None, 0
    driver = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", text)
    n_gpus = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None), n_gpus


def nvidia_driver() -> dict[str, Any]:
    """The NVIDIA driver as the operating system sees it, independently of torch.

    Reads ``/proc/driver/nvidia``, asks the driver library for its CUDA version and falls back
    to ``nvidia-smi``. Creates no CUDA context.

    Returns:
        ``version`` (the driver's, e.g. ``"550.54.15"``), ``cuda`` (the newest CUDA version it
        supports, e.g. ``"12.4"``) and ``n_gpus`` (NVIDIA GPUs the driver manages); ``None``
        and 0 where there is no driver.
    """
    import re

    version = None
    try:
        with open("/proc/driver/nvidia/version") as f:
            found = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", f.read())
        version = found.group(1) if found else None
    except OSError:
        pass
    try:
        n_gpus = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        n_gpus = 0
    cuda = _libcuda_version()
    if version is None or cuda is None or n_gpus == 0:
        smi_version, smi_cuda, smi_gpus = _nvidia_smi()
        version, cuda, n_gpus = version or smi_version, cuda or smi_cuda, n_gpus or smi_gpus
    return {"version": version, "cuda": cuda, "n_gpus": n_gpus}


def host_memory_bytes() -> int:
    """The machine's memory (RAM), in bytes."""
    return _mem_bytes()


def _mem_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing or unsupported platform
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def native_bf16(major: int) -> bool:
    """Whether a CUDA device of compute capability ``major`` runs bfloat16 in hardware (Ampere,
    8.x, and later). ``torch.cuda.is_bf16_supported()`` also counts the emulation older GPUs
    (V100, T4) offer, where bfloat16 autocast only slows the model down.

    Example:
        >>> native_bf16(9), native_bf16(7)
        (True, False)
    """
    return major >= 8


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
        gpu_count: CUDA devices this machine has (0 on CPU).
        gpu_driver: The NVIDIA driver's version, ``None`` on CPU or where it cannot be read.
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
    gpu_count: int = 0
    gpu_driver: str | None = None

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
                bf16=native_bf16(props.major),
                fp16=True,
                cpu_threads=torch.get_num_threads(),
                cpu_capability=cpu_capability,
                compiler=compiler,
                versions=versions,
                # The machine's GPUs, not this process's view: one worker per GPU (CUDA_VISIBLE_DEVICES)
                # and one process with all of them are the same hardware.
                gpu_count=max(nvidia_driver()["n_gpus"], torch.cuda.device_count()),
                gpu_driver=nvidia_driver()["version"],
            )
        # bf16 autocast runs on any CPU, but is only worth trying where oneDNN has native
        # bf16 (AVX512-BF16, AMX) or at least AVX-512 to emulate it at reasonable speed.
        bf16 = bool(flags & {"avx512_bf16", "amx_bf16"}) or cpu_capability.startswith("AVX512")
        compiler = cxx_compiler()
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
        data["cpu_model"] = cpu_model()
        flags = _cpu_flags()  # the vector and matrix units int8 and bfloat16 speed depends on
        data["cpu_isa"] = [f for f in ISA_FLAGS if f in flags]
        return data

    def hardware_key(self) -> str:
        """A short name of the hardware, used to compare only like with like.

        Trials are grouped by it: a study shared by several machines keeps one baseline and
        one winner per key. On CUDA it names the GPU, its compute capability, how many GPUs
        the machine has and the driver; on CPU the model, instruction set and thread count.
        """
        if self.is_cuda:
            sm = f"sm{self.gpu_capability[0]}{self.gpu_capability[1]}"
            return f"{self.gpu_name} ({sm}) x{self.gpu_count}, driver {self.gpu_driver or 'unknown'}"
        model = _cpuinfo_field("model name") or platform.processor() or "unknown model"
        return f"cpu {model}, {platform.machine()} {self.cpu_capability} x{self.cpu_threads}"
