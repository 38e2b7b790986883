# SPDX-License-Identifier: Apache-2.0
"""What torch offers for planning and simulating a run without its memory, wrapped once: ``FakeTensorMode``
(tensors without storage: a forward and backward on them allocate nothing), ``MemTracker`` (live tensor storage
per device and category at every operation, real or fake), the ``"fake"`` process-group backend (one process
plays rank ``r`` of ``N``; collectives return at once) and the function DDP assigns its gradient buckets with.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .errors import private_changed

__all__ = [
    "FAKE_PG_MODULE",
    "MEM_TRACKER_MODULE",
    "FAKE_TENSOR_MODULE",
    "ddp_bucket_assignment",
    "fake_tensor_mode",
    "memory_tracker",
    "register_fake_backend",
    "tracker_bytes",
    "tracker_module_peaks",
]

FAKE_PG_MODULE = "torch.testing._internal.distributed.fake_pg"
MEM_TRACKER_MODULE = "torch.distributed._tools.mem_tracker"
FAKE_TENSOR_MODULE = "torch._subclasses.fake_tensor"


def _private_class(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise private_changed(f"{module}.{name}", exc) from exc


def fake_tensor_mode() -> Any:
    """A new ``FakeTensorMode`` that also accepts real tensors as inputs (they are converted on use)."""
    return _private_class(FAKE_TENSOR_MODULE, "FakeTensorMode")(allow_non_fake_inputs=True)


def memory_tracker() -> Any:
    """A new ``MemTracker`` (a context manager; ``track_external(*modules_or_optimizers)`` before entering)."""
    return _private_class(MEM_TRACKER_MODULE, "MemTracker")()


def tracker_bytes(tracker: Any, kind: str = "current") -> dict[str, dict[str, int]]:
    """``MemTracker.get_tracker_snapshot(kind)`` as ``{device: {category: bytes}}`` with string keys: the
    categories ``"Parameter"``, ``"Buffer"``, ``"Gradient"``, ``"Activation"``, ``"Temp"``, ``"Optstate"``,
    ``"Other"`` and ``"Total"``."""
    snapshot = tracker.get_tracker_snapshot(kind)
    return {
        str(device): {str(getattr(key, "value", key)): int(value) for key, value in snap.items()}
        for device, snap in snapshot.items()
    }


def tracker_module_peaks(tracker: Any, module: Any) -> dict[str, dict[str, int]]:
    """The tracker's snapshot as ``module``'s first forward starts and at its peak in that forward and in its last
    backward, devices summed: ``{"entry": {category: bytes}, "forward": {...}, "backward": {...}}`` (a phase the
    module did not run is missing). The first forward: a forward recomputed in backward (activation
    checkpointing) is part of the backward."""
    try:
        stats = tracker.memory_tracking.get(module)
        states = importlib.import_module(MEM_TRACKER_MODULE)._ModState
    except AttributeError as exc:
        raise private_changed(f"{MEM_TRACKER_MODULE}.MemTracker.memory_tracking", exc) from exc
    out: dict[str, dict[str, int]] = {}
    if stats is None:
        return out
    for phase, state in (("entry", states.PRE_FW), ("forward", states.PEAK_FW), ("backward", states.PEAK_BW)):
        snaps = stats.snapshots.get(state)
        if snaps:
            summed: dict[str, int] = {}
            for snap in snaps[-1 if phase == "backward" else 0].values():
                for key, value in snap.items():
                    name = str(getattr(key, "value", key))
                    summed[name] = summed.get(name, 0) + int(value)
            out[phase] = summed
    return out


def register_fake_backend() -> None:
    """Make ``init_process_group("fake", rank=r, world_size=N, store=...)`` available (idempotent)."""
    try:
        importlib.import_module(FAKE_PG_MODULE)
    except ImportError as exc:
        raise private_changed(FAKE_PG_MODULE, exc) from exc


def ddp_bucket_assignment(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """How DDP buckets ``params`` (in the order given: DDP passes them last-registered first) with its default
    limits: a first bucket of ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), then ``bucket_cap_bytes``
    each; the indices of each bucket. Works on meta tensors."""
    try:
        assign = dist._compute_bucket_assignment_by_size
        first = int(dist._DEFAULT_FIRST_BUCKET_BYTES)
    except AttributeError as exc:
        raise private_changed("torch.distributed._compute_bucket_assignment_by_size", exc) from exc
    if not params:
        return []
    limits = [first, bucket_cap_bytes] if first < bucket_cap_bytes else [bucket_cap_bytes]
    buckets, _ = assign(list(params), limits, [False] * len(params))
    return [list(b) for b in buckets]
