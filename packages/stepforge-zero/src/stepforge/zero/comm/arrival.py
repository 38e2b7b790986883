# SPDX-License-Identifier: Apache-2.0
"""A bounded wait for every rank of a group to reach a collective call, through the c10d store.

The check runs on the rendezvous store (the TCPStore behind ``init_process_group``), not on the process group's
transport: a rank that gives up leaves no half-finished gloo/NCCL operation behind, so the group stays usable
and a later call made by every rank works.

Protocol per call site (``key``): each rank adds 1 to a counter; the rank that brings it to ``world_size`` sets
``key/done``; the others wait for ``key/done`` up to ``timeout``. A rank that times out withdraws its arrival (an atomic
``add(-1)``), so a later complete round starts from a clean count; if the count had reached ``world_size`` before
the withdrawal, the round completed and it goes on instead (no rank is left alone in the collective).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from stepforge.core.torch_compat import default_store

__all__ = ["ArrivalTimeout", "wait_for_all_ranks"]


class ArrivalTimeout(RuntimeError):
    """Not every rank arrived in time; ``arrived`` is how many had."""

    def __init__(self, message: str, arrived: int) -> None:
        super().__init__(message)
        self.arrived = arrived


def wait_for_all_ranks(key: str, world_size: int, timeout_s: float) -> None:
    """Return once ``world_size`` ranks called this with ``key``; raise :class:`ArrivalTimeout` after
    ``timeout_s`` seconds otherwise (this rank's arrival then withdrawn)."""
    if world_size <= 1:
        return
    store = default_store()
    count_key, done_key = f"{key}/count", f"{key}/done"
    if store.add(count_key, 1) >= world_size:
        store.set(done_key, "1")
        return
    try:
        store.wait([done_key], datetime.timedelta(seconds=timeout_s))
        return
    except (dist.DistStoreError, RuntimeError):
        pass
    # withdraw this arrival; if the count had reached world_size first, the round completed: go on
    before = store.add(count_key, -1) + 1
    if before >= world_size:
        store.wait([done_key], datetime.timedelta(seconds=max(timeout_s, 1.0)))
        return
    raise ArrivalTimeout(f"{before} of {world_size} ranks arrived within {timeout_s:g} s", arrived=before)
