# SPDX-License-Identifier: Apache-2.0
"""Named intervals of a training step, timed on the host and on the device at once.

``with clock.span("forward"): ...`` records ``time.perf_counter()`` and, on CUDA, a ``torch.cuda.Event`` at enter
and at exit. :meth:`StepClock.totals` then gives, per name, the host milliseconds (how long the Python code ran,
blocking copies and waits included) and the device milliseconds (the GPU timeline between the two events, so the
work those lines issued, excluding what was queued before them). ``clock.span`` is also an observer for
``LowLevelZeroOptimizer.observe_phases`` (:mod:`stepforge.zero.phases`).

Where the host ran longer than the device between the same two points, the difference is host time the device
did not wait for (CPU work hidden behind queued GPU work) when the device stream was busy at the enter event, or
host time the device sat idle for when it was not: a bench reads the two together with the step's wall time.
Off CUDA the device figures equal the host's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StepClock"]


@dataclass
class _Span:
    name: str
    host_start: float
    host_end: float = 0.0
    start: Any = None  # torch.cuda.Event
    end: Any = None


class StepClock:
    """Spans of one or more steps; :meth:`totals` sums them per name (synchronising the device first)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[_Span] = []

    def _event(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (several spans of one name add up)."""
        span = _Span(name, time.perf_counter(), start=self._event())
        try:
            yield
        finally:
            span.end = self._event()
            span.host_end = time.perf_counter()
            self.spans.append(span)

    def totals(self) -> dict[str, dict[str, float]]:
        """Per name: ``host_ms``, ``device_ms`` and ``count``, summed over the recorded spans."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, dict[str, float]] = {}
        for s in self.spans:
            host = (s.host_end - s.host_start) * 1e3
            device = s.start.elapsed_time(s.end) if self.cuda else host
            entry = out.setdefault(s.name, {"host_ms": 0.0, "device_ms": 0.0, "count": 0})
            entry["host_ms"] += host
            entry["device_ms"] += device
            entry["count"] += 1
        return out

    def clear(self) -> None:
        """Forget the spans (start the next step)."""
        self.spans.clear()
