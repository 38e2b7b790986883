# SPDX-License-Identifier: Apache-2.0
"""The capacity search's decisions, apart from running anything: which depth to try next, and what the tries so far
predict.

The search doubles the depth from ``start`` until a try fails, then bisects between the deepest pass (``lo``) and
the shallowest failure above it (``hi``) until ``hi - lo <= resolution``. The bytes each passing try measured guide
both without replacing them: a straight line through the measured peak bytes against the parameter count (through
the origin from a single try) predicts the deepest model that fits each limit, and

- while doubling, the next depth is the prediction (one past it when the prediction is ``lo`` itself), held within
  ``(lo, 2 lo]``, so a good prediction ends the doubling at once and a bad one costs no more than plain doubling;
- while bisecting, the prediction replaces the midpoint when it lies strictly inside ``(lo, hi)``, and ``lo + 1``
  is tried when it says ``lo`` is the deepest (confirming the bracket in one step).

A failing try never moves ``lo``; only measured passes count as results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Bracket", "TryResult", "bracket", "next_depth", "predict_max_depth"]


@dataclass(frozen=True)
class TryResult:
    """What one try found: ``ok`` (trained its steps with a finite loss), the parameter count, and the peak bytes
    it held on the device and on the host beyond its start-up (``None``: not measured)."""

    depth: int
    ok: bool
    parameters: int
    device_bytes: int | None = None
    host_bytes: int | None = None


@dataclass(frozen=True)
class Bracket:
    """``lo``: the deepest passing depth (0: none passed); ``hi``: the shallowest failing depth above it (``None``:
    none failed above ``lo``)."""

    lo: int
    hi: int | None


def bracket(tries: Sequence[TryResult]) -> Bracket:
    """The search bracket of ``tries`` (failures at or below the deepest pass are ignored: they do not bound it)."""
    lo = max((t.depth for t in tries if t.ok), default=0)
    hi = min((t.depth for t in tries if not t.ok and t.depth > lo), default=None)
    return Bracket(lo, hi)


def _fit(points: list[tuple[int, int]]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of bytes against parameters: the line through the two points furthest apart, or
    through the origin and the single point."""
    points = sorted(set(points))
    if not points:
        return None
    (p0, b0), (p1, b1) = points[0], points[-1]
    if p1 == p0:
        return (0.0, b1 / p1) if p1 > 0 else None
    slope = (b1 - b0) / (p1 - p0)
    if slope <= 0:
        return (0.0, b1 / p1)  # noise: fall back to the proportional (conservative) line
    return (b0 - slope * p0, slope)


def predict_max_depth(
    tries: Sequence[TryResult],
    parameters_of: Callable[[int], int],
    *,
    device_limit: int | None,
    host_limit: int | None,
    max_depth: int,
) -> int | None:
    """The deepest depth whose predicted device and host bytes both stay within their limits (a limit that is
    ``None``, or a resource no passing try measured, does not bound it); ``None`` without a passing try that
    measured a bounded resource."""
    passes = [t for t in tries if t.ok]
    best: int | None = None
    for limit, read in ((device_limit, "device_bytes"), (host_limit, "host_bytes")):
        if limit is None:
            continue
        line = _fit([(t.parameters, getattr(t, read)) for t in passes if getattr(t, read) is not None])
        if line is None:
            continue
        intercept, slope = line
        depth = 0
        lo, hi = 0, max_depth  # parameters grow with depth: the last depth within the limit, by bisection
        while lo <= hi:
            mid = (lo + hi) // 2
            if intercept + slope * parameters_of(mid) <= limit:
                depth, lo = mid, mid + 1
            else:
                hi = mid - 1
        best = depth if best is None else min(best, depth)
    return best


def next_depth(
    tries: Sequence[TryResult],
    *,
    start: int,
    max_depth: int,
    resolution: int = 1,
    predicted: int | None = None,
) -> int | None:
    """The depth to try next, or ``None`` when the bracket is resolved (``hi - lo <= resolution``), nothing fits
    (depth 1 failed) or ``max_depth`` passed. Depths already tried are never proposed again."""
    if not tries:
        return max(1, min(start, max_depth))
    tried = {t.depth for t in tries}
    b = bracket(tries)
    if b.hi is None:  # doubling
        if b.lo >= max_depth:
            return None
        upper = min(2 * b.lo, max_depth)
        if predicted is None:
            candidate = upper
        else:
            candidate = min(max(predicted + 1 if predicted <= b.lo else predicted, b.lo + 1), upper)
        while candidate in tried and candidate < upper:
            candidate += 1
        return None if candidate in tried else candidate
    if b.hi - b.lo <= resolution or b.hi <= 1:
        return None
    if predicted is not None and b.lo < predicted < b.hi:
        candidate = predicted
    elif predicted is not None and predicted == b.lo:
        candidate = b.lo + 1
    else:
        candidate = (b.lo + b.hi) // 2
    candidate = max(candidate, 1)
    return None if candidate in tried or candidate >= b.hi else candidate
