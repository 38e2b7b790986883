# SPDX-License-Identifier: Apache-2.0
"""``Accelerator``: the training device, as ColossalAI's Booster and ``get_accelerator`` know it. On the CPU
its methods answer what the CPU has instead of raising as ColossalAI's ``CpuAccelerator`` does; only the
allocator counters, which torch keeps for CUDA alone, raise."""

from __future__ import annotations

import os
import platform
import resource
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]

#: device types an Accelerator takes (ColossalAI's ``cpu``/``cuda``)
SUPPORTED_DEVICES = ("cpu", "cuda")


class Accelerator:
    """The training device: ``"cpu"``, ``"cuda"`` (the current CUDA device) or ``"cuda:N"``; another type raises
    ``ValueError``."""

    def __init__(self, device: str | torch.device) -> None:
        try:
            parsed: torch.device | None = torch.device(device)
        except RuntimeError:  # a device type torch does not know
            parsed = None
        if parsed is None or parsed.type not in SUPPORTED_DEVICES:
            raise ValueError(
                f"Accelerator: device {str(device)!r} is not supported; use one of {', '.join(SUPPORTED_DEVICES)}."
            )
        self.device = parsed

    # -- the Booster's device ------------------------------------------------------------------------------
    def bind(self) -> None:
        """Make the device current for this process (CUDA; nothing to do on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def configure_model(self, model: nn.Module) -> nn.Module:
        """``model.to(device)``."""
        return model.to(self.device)

    # -- identity ------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """``"cuda"`` or ``"cpu"``."""
        return self.device.type

    @property
    def communication_backend(self) -> str:
        """The ``torch.distributed`` backend for this device: ``nccl`` on CUDA, ``gloo`` on the CPU."""
        return "nccl" if self._cuda else "gloo"

    @property
    def support_set_device(self) -> bool:
        """Whether :meth:`set_device` binds the process to one of several devices (CUDA)."""
        return self._cuda

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def is_available(self) -> bool:
        """Whether torch can use the device (the CPU always)."""
        return torch.cuda.is_available() if self._cuda else True

    def device_count(self) -> int:
        """Devices of this type on the machine (the CPU counts as one, as ``torch.cpu.device_count()``)."""
        return torch.cuda.device_count() if self._cuda else torch.cpu.device_count()

    def get_current_device(self) -> torch.device:
        """The device tensors of this process go to: ``cuda:N`` (the given index, else the current CUDA device)
        or ``cpu``."""
        if self._cuda:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return torch.device("cuda", index)
        return torch.device("cpu")

    def current_device(self) -> int:
        """The index of :meth:`get_current_device` (0 on the CPU)."""
        index = self.get_current_device().index
        return 0 if index is None else index

    def set_device(self, device: int | torch.device | None = None) -> None:
        """Bind the process to ``device`` (``None``: ``LOCAL_RANK``, else the rank, modulo the device count);
        the CPU is one device: ``None``, ``0`` and ``"cpu"`` change nothing."""
        if not self._cuda:
            if device not in (None, 0) and torch.device(device).type != "cpu":
                raise ValueError(f"Accelerator(cpu).set_device: there is one CPU device, got {device!r}.")
            return
        if device is None:
            rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
            device = rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def get_device_name(self, device: Any = None) -> str:
        """The GPU's name, or the processor's on the CPU."""
        return torch.cuda.get_device_name(device) if self._cuda else (platform.processor() or "cpu")

    # -- synchronisation and memory ------------------------------------------------------------------------
    def synchronize(self, device: Any = None) -> None:
        """Wait for the device's queued work (CUDA); the CPU runs synchronously, so it returns at once."""
        if self._cuda:
            torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        """Release the CUDA caching allocator's unused blocks; the CPU allocator caches none."""
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device: Any = None) -> int:
        """Bytes held by tensors on the GPU (``torch.cuda.memory_allocated``)."""
        self._require_cuda("memory_allocated")
        return int(torch.cuda.memory_allocated(device))

    def max_memory_allocated(self, device: Any = None) -> int:
        """Peak of :meth:`memory_allocated` since the start or :meth:`reset_peak_memory_stats`."""
        self._require_cuda("max_memory_allocated")
        return int(torch.cuda.max_memory_allocated(device))

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """Restart the peak counters (``torch.cuda.reset_peak_memory_stats``)."""
        self._require_cuda("reset_peak_memory_stats")
        torch.cuda.reset_peak_memory_stats(device)

    def max_memory_reserved(self, device: Any = None) -> int:
        """Peak bytes the CUDA caching allocator reserved; on the CPU the process's peak resident memory."""
        if self._cuda:
            return int(torch.cuda.max_memory_reserved(device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def _require_cuda(self, what: str) -> None:
        if not self._cuda:
            raise RuntimeError(
                f"Accelerator(cpu).{what}: torch counts allocator bytes for CUDA only; on the CPU use "
                "max_memory_reserved() (the process's peak resident memory)."
            )

    # -- randomness ----------------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator (the CPU generator on the CPU)."""
        (torch.cuda if self._cuda else torch).manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of every device of this type."""
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def get_rng_state(self) -> torch.Tensor:
        """The current device's generator state."""
        return torch.cuda.get_rng_state() if self._cuda else torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state from :meth:`get_rng_state`."""
        (torch.cuda if self._cuda else torch).set_rng_state(state)

    def __repr__(self) -> str:
        return f"Accelerator({str(self.device)!r})"


_PROCESS_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator (ColossalAI's ``colossalai.accelerator.get_accelerator``): CUDA when torch sees
    a GPU, else the CPU; :func:`set_accelerator` replaces it."""
    global _PROCESS_ACCELERATOR
    if _PROCESS_ACCELERATOR is None:
        _PROCESS_ACCELERATOR = Accelerator("cuda" if torch.cuda.is_available() else "cpu")
    return _PROCESS_ACCELERATOR


def set_accelerator(accelerator: str | Accelerator) -> None:
    """Choose the process's accelerator: ``"cpu"``, ``"cuda"`` or an :class:`Accelerator` (else ``TypeError``)."""
    global _PROCESS_ACCELERATOR
    if isinstance(accelerator, str):
        accelerator = Accelerator(accelerator)
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"set_accelerator: accelerator must be 'cpu', 'cuda' or an Accelerator, got {type(accelerator).__name__}."
        )
    _PROCESS_ACCELERATOR = accelerator
