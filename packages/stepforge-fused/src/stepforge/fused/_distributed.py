# SPDX-License-Identifier: Apache-2.0
"""DTensor parameters (FSDP2 ``fully_shard``): the kernels step local shards; decisions that must be the same on
every rank (skipping a step on inf/NaN gradients) are reduced over the DTensor's device mesh.

Only ``torch.distributed`` is used, and only when a DTensor is present (``torch.distributed.tensor`` is never
imported here: a DTensor is recognised by its ``_local_tensor``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["is_dtensor", "mesh_all_true", "shard_dims"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a tensor with a local shard and a device mesh)."""
    return hasattr(t, "_local_tensor") and hasattr(t, "device_mesh")


def shard_dims(t: Any) -> list[int]:
    """The mesh dimensions over which DTensor ``t`` is split (``Shard``/partial placements; not ``Replicate``)."""
    return [dim for dim, pl in enumerate(t.placements) if not pl.is_replicate()]


def _groups(t: Any) -> list[Any]:
    mesh = t.device_mesh
    return [mesh.get_group(dim) for dim in shard_dims(t)]


def mesh_all_true(flag: bool, tensors: Iterable[Any]) -> bool:
    """Whether ``flag`` holds on every rank sharing a shard of any of ``tensors`` (all-reduce MIN)."""
    import torch.distributed as dist

    seen: set[int] = set()
    result = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32)
    for t in tensors:
        if not is_dtensor(t):
            continue
        for group in _groups(t):
            if id(group) in seen:
                continue
            seen.add(id(group))
            buf = result.to(_comm_device(t))
            dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=group)
            result = buf.cpu()
    return bool(result.item() > 0)


def _comm_device(t: Any) -> torch.device:
    mesh_type = t.device_mesh.device_type
    return torch.device("cpu") if mesh_type == "cpu" else t._local_tensor.device
