# SPDX-License-Identifier: Apache-2.0
"""Round-robin timing of the stepforge benchmark scripts, and their thread setup.

- :func:`configure_threads` sets the intra-op thread count. torch ships its own ``libgomp`` and a process loads
  one OpenMP runtime, so ``torch.set_num_threads`` also governs stepforge's OpenMP kernels.
- :func:`time_interleaved` times several callables round-robin (A, B, A, B, ...) after a warm-up, with the
  garbage collector off, and reports the median of the repeats. On a shared machine the load changes over
  seconds; interleaving lets every contender see the same load, so the *ratios* are the numbers to trust.

The scripts import this module as ``from bench.common import _timing`` (a script puts ``tools/`` first on
``sys.path``; see tools/bench/README.md).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Timing", "configure_threads", "time_interleaved"]


@dataclass
class Timing:
    """Wall-clock samples of one callable, in milliseconds."""

    samples_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else math.nan

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms) if self.samples_ms else math.nan

    @property
    def spread(self) -> float:
        """(p75 - p25) / median: how noisy the samples were (0.05 = 5 %)."""
        if len(self.samples_ms) < 4:
            return math.nan
        q = statistics.quantiles(self.samples_ms, n=4)
        return (q[2] - q[0]) / self.median_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "iqr_over_median": self.spread,
            "samples_ms": [round(s, 4) for s in self.samples_ms],
        }


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    repeats: int = 10,
    before: Mapping[str, Callable[[], Any]] | None = None,
) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, round-robin, after ``warmup`` untimed calls each.

    Args:
        fns: name -> the call to time (e.g. ``optimizer.step``).
        warmup: untimed calls per callable first (the first optimizer step allocates its state).
        repeats: timed calls per callable; report the median.
        before: name -> an untimed call made right before each call of ``fns[name]`` (e.g. handing the
            optimizer a fresh set of gradients).

    Returns:
        name -> :class:`Timing`.
    """
    before = before or {}
    noop: Callable[[], Any] = lambda: None  # noqa: E731
    out = {name: Timing() for name in fns}
    gc_was_enabled = gc.isenabled()
    try:
        for _ in range(warmup):
            for name, fn in fns.items():
                before.get(name, noop)()
                fn()
        gc.collect()
        gc.disable()  # a collection inside a timed call would be charged to whoever triggered it
        for _ in range(repeats):
            for name, fn in fns.items():
                before.get(name, noop)()
                t0 = time.perf_counter_ns()
                fn()
                out[name].samples_ms.append((time.perf_counter_ns() - t0) / 1e6)
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (which also drives stepforge's OpenMP kernels); returns it."""
    import torch

    if threads is None or threads <= 0:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads)
    return torch.get_num_threads()
