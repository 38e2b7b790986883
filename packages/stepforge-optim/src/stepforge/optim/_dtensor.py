# SPDX-License-Identifier: Apache-2.0
"""DTensor (FSDP2) parameters: the update runs on each rank's local shard; per-parameter norms are reduced.

An elementwise update is the same on a shard as on the whole tensor. A norm is not: the L2 norm of a sharded
parameter is ``sqrt(sum over the shards of the local squared norms)``, summed over the mesh dimensions the
tensor is sharded on (replicated dimensions already hold the same values). With that reduction an FSDP2 run
of :class:`Lamb`/:class:`Lars` equals the unsharded run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stepforge.core.torch_compat import dtensor_local as local  # the shard itself, same storage
from stepforge.core.torch_compat import is_dtensor

__all__ = ["is_dtensor", "local", "mesh_key", "reduce_square_sums", "reduce_norms"]


def mesh_key(t: Any) -> Any:
    """Bucket key part: tensors of one bucket share a mesh and placements (``None`` for plain tensors)."""
    if not is_dtensor(t):
        return None
    return (id(t.device_mesh), tuple(str(p) for p in t.placements))


def reduce_square_sums(squares: torch.Tensor, like: Any) -> torch.Tensor:
    """All-reduce (sum) ``squares`` (local sums of squares) over the mesh dimensions ``like`` is sharded on."""
    if not is_dtensor(like) or not dist.is_initialized():
        return squares
    mesh = like.device_mesh
    for dim, placement in enumerate(like.placements):
        if placement.is_shard():
            dist.all_reduce(squares, group=mesh.get_group(dim))
    return squares


def reduce_norms(norms: torch.Tensor, like: Any) -> torch.Tensor:
    """Global L2 norms from per-shard L2 norms (one entry per tensor of a bucket of DTensors)."""
    if not is_dtensor(like) or not dist.is_initialized():
        return norms
    return reduce_square_sums(norms.square(), like).sqrt()
