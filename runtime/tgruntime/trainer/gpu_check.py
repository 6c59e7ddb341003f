"""GPU or fail: a rank asked for a GPU that finds no CUDA device refuses to start.

A rank of a group with ``workers.useGpu: true`` that sees no CUDA device (typically a node
whose NVIDIA driver is older than the one the image's torch was built for) used to fall back
to the CPU with gloo: the group became Ready, held its GPUs and trained ~100x slower. It now
raises :class:`NoCudaDeviceError`, whose one-line message says which driver the node has,
which CUDA the image's torch needs and the minimum driver for it, and the fix. The message
reaches the caller of ``init_model`` (``WorkerMethodError``), the server's
``TG_GROUP_FAILED`` line, ``tgctl up`` and, through the server job, the TrainerGroup's
Failed condition.

The minimum drivers are those of CUDA's minor-version compatibility on Linux: every CUDA
12.x runtime runs on a 525.60.13 driver or newer, every CUDA 13.x runtime on 580.65.06.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tgapi.errors import PicklableError

__all__ = [
    "CPU_FALLBACK_ENV",
    "MIN_DRIVER",
    "NO_DRIVER",
    "GpuWorkersOnCpuError",
    "NoCudaDeviceError",
    "cpu_fallback_allowed",
    "driver_version",
    "min_driver_for",
    "no_cuda_error",
    "nvidia_device_nodes",
]

CPU_FALLBACK_ENV = "TG_ALLOW_CPU_FALLBACK"
"""Set to 1 in the runtime image's CPU variant (images/runtime.Dockerfile, stage cuda-cpu):
that image has no CUDA libraries, so GPU-or-fail cannot hold on it; its workers given GPUs
(the kind suite's fake ``nvidia.com/gpu``) run on the CPU with a warning, and status.device
says cpu. Never set in the GPU image."""


def cpu_fallback_allowed() -> bool:
    """Whether this process may run a GPU-asking rank on the CPU (:data:`CPU_FALLBACK_ENV`)."""
    return os.environ.get(CPU_FALLBACK_ENV, "") == "1"

NO_DRIVER = "no NVIDIA driver"
PROC_VERSION = Path("/proc/driver/nvidia/version")

MIN_DRIVER: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
"""CUDA major version -> the oldest Linux driver that runs every runtime of that major."""

CUDA12_IMAGE_DRIVER = MIN_DRIVER[12]
"""What the runtime image variant built for CUDA 12 (torch's cu12 wheels) needs."""

_VERSION = re.compile(r"\b(\d{3,4}\.\d+(?:\.\d+)?)\b")


class NoCudaDeviceError(PicklableError, RuntimeError):
    """A rank was asked for a GPU (``workers.useGpu: true``) and torch sees no CUDA device.

    ``driver``: the NVIDIA driver version seen on the node (or why none was read);
    ``torch_cuda``: the CUDA version the image's torch was built for (None: a CPU-only
    build); ``min_driver``: the oldest driver for that CUDA; ``fix``: what to change.
    """

    def __init__(
        self,
        *,
        rank: int | None,
        driver: str,
        torch_cuda: str | None,
        min_driver: str | None,
        fix: str,
    ) -> None:
        self.rank = rank
        self.driver = driver
        self.torch_cuda = torch_cuda
        self.min_driver = min_driver
        self.fix = fix
        who = f"rank {rank}" if rank is not None else "this process"
        if torch_cuda is None:
            needs = "this image's torch is a CPU-only build (torch.version.cuda is None)"
        else:
            needs = f"this image's torch is built for CUDA {torch_cuda}"
            needs += f", which needs NVIDIA driver >= {min_driver}" if min_driver else ""
        super().__init__(
            f"workers.useGpu is true but {who} sees no CUDA device "
            f"(torch.cuda.is_available() is False): NVIDIA driver seen: {driver}; {needs}. "
            f"Fix: {fix}"
        )


class GpuWorkersOnCpuError(PicklableError, RuntimeError):
    """The server's check: ``workers.useGpu`` is true but the workers' ``init_model`` results
    say they run on the CPU (a worker class of the user's own that fell back)."""

    def __init__(self, *, device: str, torch_cuda: str | None) -> None:
        self.device = device
        self.torch_cuda = torch_cuda
        minimum = min_driver_for(torch_cuda)
        needs = (
            f" (this image's torch is built for CUDA {torch_cuda}: NVIDIA driver >= {minimum})"
            if torch_cuda and minimum
            else ""
        )
        super().__init__(
            f"workers.useGpu is true but the workers report device {device!r} from init_model: "
            "they would hold GPUs and train on the CPU. Fix: run on nodes whose NVIDIA driver "
            f"supports the image's CUDA{needs}, or use the runtime image variant built for "
            f"CUDA 12 (driver >= {CUDA12_IMAGE_DRIVER}), or set workers.useGpu: false"
        )


def min_driver_for(cuda: str | None) -> str | None:
    """The oldest Linux driver for CUDA runtime ``cuda`` ("13.0", "12.8"); None if unknown."""
    if not cuda:
        return None
    try:
        major = int(cuda.split(".", 1)[0])
    except ValueError:
        return None
    return MIN_DRIVER.get(major)


def driver_version(
    proc_version: Path = PROC_VERSION, smi: str | None = "nvidia-smi", timeout_s: float = 10.0
) -> str:
    """The NVIDIA driver version of this node, or a phrase saying why none was read.

    In order: ``/proc/driver/nvidia/version`` (the kernel module's "NVRM version" line),
    then ``nvidia-smi --query-gpu=driver_version`` when the binary exists (bounded by
    ``timeout_s``), else :data:`NO_DRIVER`.
    """
    try:
        text = proc_version.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("NVRM"):
            found = _VERSION.search(line)
            if found:
                return found.group(1)
    path = shutil.which(smi) if smi else None
    if path is None:
        return NO_DRIVER
    try:
        out = subprocess.run(
            [path, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return f"{NO_DRIVER} (nvidia-smi failed or took over {timeout_s:g}s)"
    found = _VERSION.search(out.stdout) if out.returncode == 0 else None
    if found:
        return found.group(1)
    said = (out.stdout + out.stderr).strip().splitlines()
    return f"{NO_DRIVER} (nvidia-smi exit {out.returncode}: {said[0][:160] if said else ''})"


def _older(driver: str, minimum: str) -> bool | None:
    """``driver`` < ``minimum`` (None when ``driver`` is not a version)."""
    if not _VERSION.fullmatch(driver):
        return None
    have = tuple(int(p) for p in driver.split("."))
    need = tuple(int(p) for p in minimum.split("."))
    return have < need


def no_cuda_error(
    *, rank: int | None, driver: str | None = None, torch_cuda: str | None = None,
    probe_torch: bool = True,
) -> NoCudaDeviceError:
    """The error for a rank that wants a GPU and finds none, with the node's facts filled in.

    ``driver``/``torch_cuda`` default to what this node and this torch say
    (:func:`driver_version`, ``torch.version.cuda``); ``probe_torch=False`` keeps the given
    ``torch_cuda`` even when it is None.
    """
    if driver is None:
        driver = driver_version()
    if probe_torch and torch_cuda is None:
        import torch

        torch_cuda = torch.version.cuda
    minimum = min_driver_for(torch_cuda)
    off = "or set workers.useGpu: false to train on the CPU (gloo, float32)"
    if torch_cuda is None:
        fix = f"use the runtime image built with CUDA (not a CPU-only torch), {off}"
    elif minimum is None:
        fix = f"run on nodes whose NVIDIA driver supports CUDA {torch_cuda}, {off}"
    else:
        older = _older(driver, minimum)
        variant = (
            f"or use the runtime image variant built for CUDA 12 (torch's cu12 wheels, "
            f"driver >= {CUDA12_IMAGE_DRIVER})"
            if not torch_cuda.startswith("12.")
            else ""
        )
        if older is False:  # the driver is recent enough: the device itself is missing
            fix = (
                f"the driver meets the minimum, so the GPU is not visible to this process: "
                "give the pod its GPUs (an nvidia.com/gpu limit, the NVIDIA container runtime "
                f"or runtimeClassName) and check CUDA_VISIBLE_DEVICES, {off}"
            )
        else:
            parts = [f"run on nodes with NVIDIA driver >= {minimum}"]
            if variant:
                parts.append(variant)
            fix = ", ".join(parts) + f", {off}"
    return NoCudaDeviceError(
        rank=rank, driver=driver, torch_cuda=torch_cuda, min_driver=minimum, fix=fix
    )


def nvidia_device_nodes(names: list[str]) -> bool:
    """Whether these ``/dev`` entries include an NVIDIA device (``nvidiactl`` or ``nvidiaN``)."""
    return any(
        name == "nvidiactl" or (name.startswith("nvidia") and name[6:].isdigit()) for name in names
    )
