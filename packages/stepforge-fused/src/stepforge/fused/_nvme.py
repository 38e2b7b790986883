# SPDX-License-Identifier: Apache-2.0
"""NVMe offload of optimizer state (ColossalAI's ``nvme_offload_fraction`` / ``nvme_offload_dir``).

A fraction of the float32 state of CPU parameters, largest parameters first, lives in files memory-mapped with
``torch.from_file(..., shared=True)``: CPU tensors whose pages belong to a file's page cache instead of the
process's anonymous memory, so the OS writes them back and evicts them under memory pressure, while the kernels
step them in place (no copies, no prefetch thread). The files' directory, created under ``nvme_offload_dir`` (or
the temp dir), is removed by :meth:`NvmeStateStore.close` or when the store is garbage collected.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable

import torch

from stepforge.core import HyperParameterError

__all__ = ["NvmeStateStore", "check_nvme_args"]

# Float32 state keys that are stored in files for an offloaded parameter (the step counter stays in memory).
OFFLOADED_KEYS = ("exp_avg", "exp_avg_sq", "master_param")


def check_nvme_args(owner: str, fraction: object, directory: object) -> float:
    """Validate ``nvme_offload_fraction`` / ``nvme_offload_dir`` where they enter; returns the fraction."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise HyperParameterError(
            f"{owner}: nvme_offload_fraction must be a number in [0, 1], got {fraction!r} "
            f"({type(fraction).__name__})."
        )
    value = float(fraction)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise HyperParameterError(
            f"{owner}: nvme_offload_fraction must be in [0, 1] (the share of the optimizer state kept in files), "
            f"got {fraction!r}."
        )
    if directory is not None:
        if not isinstance(directory, (str, os.PathLike)):
            raise HyperParameterError(
                f"{owner}: nvme_offload_dir must be a path (str or os.PathLike) or None, got "
                f"{type(directory).__name__}."
            )
        path = os.fspath(directory)
        if not os.path.isdir(path):
            raise HyperParameterError(
                f"{owner}: nvme_offload_dir={path!r} is not an existing directory; create it first or pass "
                "None for a temporary directory."
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise HyperParameterError(
                f"{owner}: nvme_offload_dir={path!r} is not writable; pick a directory this process can write."
            )
    return value


class NvmeStateStore:
    """Decides which parameters' state is file-backed (``fraction`` of the CPU parameter elements) and creates
    those tensors, in a fresh sub-directory of ``directory`` (the temp dir when None); ``owner`` names messages."""

    def __init__(self, owner: str, fraction: float, directory: str | os.PathLike[str] | None) -> None:
        self.owner = owner
        self.fraction = fraction
        parent = None if directory is None else os.fspath(directory)
        self.path = tempfile.mkdtemp(prefix="stepforge-nvme-", dir=parent)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)
        self._decided: dict[int, bool] = {}  # id(param) -> offloaded
        self._total = 0
        self._offloaded = 0
        self._files = 0
        self._owned: set[int] = set()  # data_ptr() of the file-backed tensors created here

    def close(self) -> None:
        """Remove the directory and its files. Mapped tensors stay readable (the mapping outlives the unlink)."""
        self._finalizer()

    def plan(self, params: Iterable[torch.Tensor]) -> None:
        """Decide for parameters not seen yet: largest first, offloaded while the offloaded elements stay within
        ``fraction`` of all CPU parameter elements. Earlier decisions are kept."""
        new = [p for p in params if id(p) not in self._decided]
        if not new:
            return
        cpu = [p for p in new if p.device.type == "cpu"]
        for p in new:
            self._decided[id(p)] = False
        self._total += sum(p.numel() for p in cpu)
        budget = self.fraction * self._total
        for p in sorted(cpu, key=lambda t: t.numel(), reverse=True):
            if self._offloaded + p.numel() <= budget + 1e-9:
                self._decided[id(p)] = True
                self._offloaded += p.numel()

    def file_tensor(self, value: torch.Tensor) -> torch.Tensor:
        """A file-backed float32 copy of ``value`` (same shape, contiguous)."""
        if not self._finalizer.alive:
            raise RuntimeError(f"{self.owner}: the NVMe offload store was closed; build a new optimizer.")
        name = os.path.join(self.path, f"state-{self._files}.bin")
        self._files += 1
        numel = value.numel()
        with open(name, "wb") as f:
            f.truncate(numel * 4)  # a sparse file of zeros
        out = torch.from_file(name, shared=True, size=numel, dtype=torch.float32).view(value.shape)
        if value.any():
            out.copy_(value)
        self._owned.add(out.data_ptr())
        return out

    def adopt(self, p: torch.Tensor, state: dict[str, object]) -> None:
        """Move the float32 state tensors of an offloaded CPU parameter into files (no-op when already there)."""
        if not self._decided.get(id(p), False):
            return
        for key in OFFLOADED_KEYS:
            t = state.get(key)
            if (
                isinstance(t, torch.Tensor)
                and t.device.type == "cpu"
                and t.numel()
                and t.data_ptr() not in self._owned
            ):
                state[key] = self.file_tensor(t.detach().to(torch.float32))

    def file_bytes(self) -> int:
        """Bytes allocated in the store's files."""
        if not self._finalizer.alive:
            return 0
        return sum(os.path.getsize(os.path.join(self.path, n)) for n in os.listdir(self.path))
