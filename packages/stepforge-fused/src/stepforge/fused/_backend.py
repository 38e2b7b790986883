# SPDX-License-Identifier: Apache-2.0
"""Loading the kernel modules and choosing one per device (contract: ``csrc/README.md``).

``_cpu`` is always built; ``_cuda`` only with ``STEPFORGE_CUDA=ON`` (or ``AUTO`` and nvcc found). Both expose the
same kernel functions, so the optimizers call ``module_for(device).adam(...)`` and never branch on the device.
One loader (:func:`_load`), one dtype table (:data:`DTYPE_CODES`), one error class
(:class:`BackendUnavailableError`). The ``_cuda`` extension links the CUDA runtime statically, so it imports on
machines without a GPU; :func:`cuda_status` then says why it cannot run.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from stepforge.core import StepforgeError

__all__ = [
    "BackendUnavailableError",
    "DTYPE_CODES",
    "cpu_module",
    "cuda_available",
    "cuda_module",
    "cuda_status",
    "module_for",
    "has_cuda",
    "cpu_features",
    "set_cpu_isa",
    "set_num_threads",
    "get_num_threads",
    "dtype_code",
]

#: dtype codes of the kernel contract (csrc/README.md); never reorder.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class BackendUnavailableError(StepforgeError, RuntimeError):
    """A kernel module needed for a tensor's device is not available; the message says how to get it."""


@functools.cache
def _load(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(f"stepforge.fused.{name}"), ""
    except ImportError as exc:  # not built, or built for another Python / missing runtime libraries
        return None, f"{type(exc).__name__}: {exc}"


def cpu_module() -> ModuleType:
    """The ``_cpu`` kernel module.

    Raises:
        BackendUnavailableError: the extension is missing or failed to import (a broken install).
    """
    mod, why = _load("_cpu")
    if mod is None:
        raise BackendUnavailableError(
            "stepforge-fused: the CPU kernel module stepforge.fused._cpu could not be imported "
            f"({why}). Reinstall the package: pip install --force-reinstall packages/stepforge-fused"
        )
    return mod


def cuda_module() -> ModuleType:
    """The ``_cuda`` kernel module.

    Raises:
        BackendUnavailableError: built without CUDA (rebuild with ``STEPFORGE_CUDA=ON``), or no CUDA device.
    """
    mod, why = _load("_cuda")
    if mod is None:
        raise BackendUnavailableError(
            "stepforge-fused was built without its CUDA module, so CUDA tensors cannot be stepped "
            f"({why}). Rebuild with nvcc on PATH: STEPFORGE_CUDA=ON pip install packages/stepforge-fused "
            "(architectures via STEPFORGE_CUDA_ARCHS, default '80;90')."
        )
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "stepforge-fused: CUDA tensors were passed but torch sees no CUDA device "
            "(torch.cuda.is_available() is False); move the parameters to a GPU machine or to the CPU."
        )
    return mod


def cuda_status() -> str:
    """One line for humans: built architectures and runtime, and the device or why there is none.

    Composed here from the module's small queries and torch's device names: the C++ status string this replaced
    crashed the process once a device was present (an H200, driver 580), while each of these queries ran fine.

    Returns:
        e.g. ``"built for sm_90 (cubin), sm_90 (PTX); CUDA 13.0 (static runtime); 1 device(s): 0=NVIDIA H200
        sm_90"``, ``"...; no CUDA driver/device: stepforge CUDA error in cudaGetDeviceCount:
        cudaErrorInsufficientDriver (...)"``, or why the module is missing and how to build it.
    """
    mod, why = _load("_cuda")
    if mod is None:
        return (
            "stepforge-fused was built without CUDA; rebuild with STEPFORGE_CUDA=ON and nvcc on PATH "
            f"(STEPFORGE_CUDA=ON pip install --no-build-isolation packages/stepforge-fused) ({why})"
        )
    built = ", ".join(_describe_arch(a) for a in mod.built_archs())
    status = f"built for {built}; CUDA {mod.TOOLKIT_VERSION} (static runtime)"
    if not mod.available():
        try:
            mod.device_count()
        except RuntimeError as exc:
            status += f"; no CUDA driver/device: {exc}"
            if mod.driver_version() == 0:
                status += "; no NVIDIA driver is installed or loadable (libcuda.so)"
            return status
        return status + "; no CUDA device visible"
    if not torch.cuda.is_available():
        return status + f"; but torch {torch.__version__} cannot use CUDA (a CPU-only torch build?)"
    devices = []
    for d in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(d)
        devices.append(f"{d}={torch.cuda.get_device_name(d)} sm_{major}{minor}")
    return status + f"; {len(devices)} device(s): " + ", ".join(devices)


def _describe_arch(arch: str) -> str:
    """``"90-real"`` -> ``"sm_90 (cubin)"``, ``"90-virtual"`` -> ``"sm_90 (PTX)"``."""
    sm, _, kind = arch.partition("-")
    return f"sm_{sm} ({'PTX' if kind == 'virtual' else 'cubin'})"


def cuda_available() -> bool:
    """Whether the CUDA kernels can run: module built, a device visible to it and to torch."""
    mod = _load("_cuda")[0]
    return mod is not None and bool(mod.available()) and torch.cuda.is_available()


def has_cuda() -> bool:
    """True when the ``_cuda`` module was built into this install (a GPU is not required)."""
    return _load("_cuda")[0] is not None


def module_for(device: torch.device) -> ModuleType:
    """The kernel module for tensors on ``device`` (``cpu`` -> ``_cpu``, ``cuda`` -> ``_cuda``).

    Raises:
        BackendUnavailableError: the device type has no kernels (or its module is missing).
    """
    if device.type == "cpu":
        return cpu_module()
    if device.type == "cuda":
        return cuda_module()
    raise BackendUnavailableError(
        f"stepforge-fused has kernels for CPU and CUDA tensors only, got a tensor on {device}; "
        "move the parameters or use a torch.optim optimizer."
    )


def dtype_code(dtype: torch.dtype, *, what: str, owner: str) -> int:
    """Kernel dtype code of ``dtype``; raises a TypeError naming ``what`` for unsupported dtypes."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(
            f"{owner}: {what} has dtype {dtype}; the fused kernels support float32, float16 and bfloat16. "
            "Cast the parameter (e.g. model.float()) or use a torch.optim optimizer."
        ) from None


_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Threads used by the CPU kernels; ``None`` (default) follows ``torch.get_num_threads()`` at each call."""
    global _threads
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"set_num_threads: n must be a positive int or None, got {n!r}")
    _threads = n


def get_num_threads() -> int:
    """Threads the next CPU kernel call will use."""
    return _threads if _threads is not None else torch.get_num_threads()


def cpu_features() -> dict[str, Any]:
    """What the CPU module chose: ``isa`` (active path), ``supported``, ``compiled``, ``forced_by_env``
    (``STEPFORGE_CPU_ISA``), ``openmp``, ``num_threads`` (what the kernels will use) and raw ``cpu_flags``."""
    info = dict(cpu_module().cpu_features())
    info["num_threads"] = get_num_threads()
    return info


def set_cpu_isa(name: str) -> None:
    """Switch the CPU kernel path at run time (``"scalar"``, ``"avx2"``, ``"avx512"`` or ``"auto"``)."""
    cpu_module().set_isa(name)
