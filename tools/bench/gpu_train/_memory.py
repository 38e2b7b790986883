# SPDX-License-Identifier: Apache-2.0
"""What a training process holds: host resident memory (now, peak, the machine's available), the device's peaks,
and a guard that ends a try before the host runs out of memory.

Host figures come from ``/proc`` (Linux); elsewhere they are ``None``. The guard exists because a try that
outgrows the host's memory would otherwise meet the kernel's OOM killer, which may pick another process than the
try; a thread polls the try's resident size and the machine's available memory and ends the process (after
recording why) before either limit is crossed. Allocating tens of GB takes seconds of page faults, so a poll every
50 ms stops a try within a few hundred MB of its limit.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common._machine import available_memory_bytes

__all__ = [
    "HostGuard",
    "device_memory",
    "host_available_bytes",
    "host_peak_rss_bytes",
    "host_rss_bytes",
    "reset_device_peak",
]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_rss_bytes() -> int | None:
    """This process's resident memory now (``/proc/self/statm``), ``None`` where there is no ``/proc``."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def host_peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``ru_maxrss``; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_available_bytes() -> int | None:
    """The machine's ``MemAvailable`` (what can be allocated without swapping), ``None`` without ``/proc``."""
    return available_memory_bytes()


def reset_device_peak(device: torch.device) -> None:
    """Start counting the device's peak anew (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def device_memory(device: torch.device) -> dict[str, Any]:
    """The device's peaks since the last reset and its size: ``peak_allocated``, ``peak_reserved``, ``total``,
    ``free`` (bytes); every value ``None`` off CUDA (the host figures then hold everything)."""
    if device.type != "cuda":
        return {"peak_allocated": None, "peak_reserved": None, "total": None, "free": None}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "peak_reserved": torch.cuda.max_memory_reserved(device),
        "total": total,
        "free": free,
    }


class HostGuard:
    """A daemon thread that calls ``on_exceeded(reason)`` and ends the process (``os._exit(exit_code)``) when this
    process's resident memory passes ``rss_limit`` bytes or the machine's available memory falls below
    ``min_available`` bytes. Also records the highest resident size it saw (:attr:`peak_rss`).

    Args:
        rss_limit: the most this process may hold (``None``: not checked).
        min_available: the least the machine must keep available (``None``: not checked).
        on_exceeded: called once with the reason, before the exit (write the try's result there).
        interval_s: the poll period.
        exit_code: the exit status of a guarded end.
    """

    def __init__(
        self,
        rss_limit: int | None,
        min_available: int | None,
        on_exceeded: Callable[[str], None],
        *,
        interval_s: float = 0.05,
        exit_code: int = 3,
    ) -> None:
        self.rss_limit, self.min_available = rss_limit, min_available
        self.on_exceeded, self.interval_s, self.exit_code = on_exceeded, interval_s, exit_code
        self.peak_rss = host_rss_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-guard", daemon=True)

    def start(self) -> HostGuard:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def check(self) -> str | None:
        """The reason to stop now, or ``None``; updates :attr:`peak_rss`."""
        rss = host_rss_bytes()
        if rss is not None:
            self.peak_rss = max(self.peak_rss, rss)
            if self.rss_limit is not None and rss > self.rss_limit:
                return f"host memory: resident {rss / 2**30:.1f} GiB passed the limit of {self.rss_limit / 2**30:.1f} GiB"
        if self.min_available is not None:
            available = host_available_bytes()
            if available is not None and available < self.min_available:
                return (
                    f"host memory: the machine's available memory fell to {available / 2**30:.1f} GiB "
                    f"(kept above {self.min_available / 2**30:.1f} GiB)"
                )
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            reason = self.check()
            if reason is not None:
                try:
                    self.on_exceeded(reason)
                finally:
                    os._exit(self.exit_code)
