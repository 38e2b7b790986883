# SPDX-License-Identifier: Apache-2.0
"""DTensor parameters (FSDP2 ``fully_shard``): the kernels step local shards; decisions that must be the same on
every rank (skipping a step, LAMB's norms) are reduced over the DTensor's device mesh (``torch.distributed`` only
when a DTensor is present; ``torch.distributed.tensor`` is never imported here)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from stepforge.core.torch_compat import dtensor_local, is_dtensor

__all__ = ["comm_device", "is_dtensor", "mesh_all_true", "mesh_sum_", "shard_dims", "shard_groups"]


def shard_dims(t: Any) -> list[int]:
    """The mesh dimensions over which DTensor ``t`` is split (``Shard``/partial placements; not ``Replicate``)."""
    return [dim for dim, pl in enumerate(t.placements) if not pl.is_replicate()]


def shard_groups(t: Any) -> list[Any]:
    """The process groups of the mesh dimensions over which DTensor ``t`` is split (see :func:`shard_dims`)."""
    mesh = t.device_mesh
    return [mesh.get_group(dim) for dim in shard_dims(t)]


def mesh_sum_(buf: torch.Tensor, groups: Iterable[Any], device: torch.device) -> torch.Tensor:
    """Sum ``buf`` over every rank of each of ``groups`` (all-reduce SUM, one group after the other; the groups
    of different mesh dimensions are disjoint, so this is the sum over all their shards). ``device``: where the
    collective runs (:func:`comm_device`). Returns the summed tensor on ``buf``'s device."""
    import torch.distributed as dist

    work = buf.to(device)
    for group in groups:
        dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group)
    return work.to(buf.device)


def mesh_all_true(flag: bool, tensors: Iterable[Any]) -> bool:
    """Whether ``flag`` holds on every rank sharing a shard of any of ``tensors`` (all-reduce MIN)."""
    import torch.distributed as dist

    seen: set[int] = set()
    result = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32)
    for t in tensors:
        if not is_dtensor(t):
            continue
        for group in shard_groups(t):
            if id(group) in seen:
                continue
            seen.add(id(group))
            buf = result.to(comm_device(t))
            dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=group)
            result = buf.cpu()
    return bool(result.item() > 0)


def comm_device(t: Any) -> torch.device:
    """Where collectives over DTensor ``t``'s mesh run: the CPU for a ``cpu`` mesh, else the shard's device."""
    mesh_type = t.device_mesh.device_type
    return torch.device("cpu") if mesh_type == "cpu" else dtensor_local(t).device
