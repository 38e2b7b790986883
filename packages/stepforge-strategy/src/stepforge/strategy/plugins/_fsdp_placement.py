# SPDX-License-Identifier: Apache-2.0
"""Where each FSDP2 unit lives: sharded or replicated, on the device or offloaded to CPU, over which mesh.

ColossalAI's Gemini decides this per parameter chunk (``shard_param_frac``, ``offload_optim_frac``,
``offload_param_frac``, ``extra_dp_size``); FSDP2 decides it per ``fully_shard`` unit (a block, or the root with
the parameters no block holds). The plan walks the units in parameter order, as Gemini walks its chunks, and
counts parameter bytes: Gemini shards and offloads chunks from the front, so do we.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["UnitPlacement", "plan_placement", "unit_params", "leading_units", "hybrid_meshes"]


@dataclass(frozen=True)
class UnitPlacement:
    """One ``fully_shard`` unit and where it lives.

    Attributes:
        name: the unit's module FQN (``""`` for the root).
        param_bytes: bytes of the parameters this unit owns (not those of nested units).
        sharded: ``True``: parameters sharded over the shard mesh dimension (ZeRO-3); ``False``: replicated on
            every rank (a ``(world, 1)`` mesh: gradients all-reduced, as Gemini's kept-gathered chunks).
        offload: ``True``: FSDP2 ``CPUOffloadPolicy``: the sharded parameters, their gradients and the optimizer
            state live in host memory and the step runs there.
    """

    name: str
    param_bytes: int
    sharded: bool
    offload: bool


def unit_params(unit: nn.Module, units: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters ``unit`` owns: its own, less those of the other ``units`` nested inside it
    (deduplicated)."""
    inside = {id(m) for m in unit.modules() if m is not unit}
    skip = {id(p) for m in units if id(m) in inside for p in m.parameters()}
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for p in unit.parameters():
        if id(p) not in skip and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def leading_units(sizes: list[int], frac: float) -> list[bool]:
    """Which units, taken from the front, cover ``frac`` of the total bytes: Gemini takes chunks until the
    bytes taken reach ``frac`` of the total (``frac=0``: none, ``frac=1``: all)."""
    total = sum(sizes)
    goal = frac * total
    taken = 0
    out = []
    for size in sizes:
        take = frac >= 1.0 or (frac > 0 and taken < goal)  # 1.0 takes every unit, empty ones included
        out.append(take)
        if take:
            taken += size
    return out


def plan_placement(
    model: nn.Module,
    blocks: list[nn.Module],
    *,
    shard_param_frac: float = 1.0,
    offload_frac: float = 0.0,
) -> dict[int, UnitPlacement]:
    """Plan ``model``'s units (``blocks`` and the root), keyed by ``id(module)``.

    Units are ordered by the position of their first parameter in ``model.parameters()``. The leading units
    holding ``shard_param_frac`` of the bytes are sharded, the rest replicated (Gemini keeps the trailing
    ``1 - shard_param_frac`` gathered). Of the sharded units, the leading ones holding ``offload_frac`` of all
    bytes are offloaded to CPU; replicated units stay on the device (Gemini's gathered chunks do too).
    """
    order = {id(p): i for i, p in enumerate(model.parameters())}
    units = [*blocks, model]
    owned = {id(u): unit_params(u, units) for u in units}
    names = {id(m): n for n, m in model.named_modules()}
    ranked = sorted(units, key=lambda u: min((order[id(p)] for p in owned[id(u)]), default=len(order)))
    sizes = [sum(p.numel() * p.element_size() for p in owned[id(u)]) for u in ranked]
    sharded = leading_units(sizes, shard_param_frac)
    # the offload budget counts all bytes, but only sharded units can take it
    total = sum(sizes)
    goal, taken = offload_frac * total, 0
    plan: dict[int, UnitPlacement] = {}
    for unit, size, shard in zip(ranked, sizes, sharded, strict=True):
        offload = shard and (offload_frac >= 1.0 or (offload_frac > 0 and taken < goal))
        if offload:
            taken += size
        plan[id(unit)] = UnitPlacement(names[id(unit)], size, shard, offload)
    return plan


def hybrid_meshes(device: torch.device, extra_dp_size: int, *, replicate: bool) -> tuple[Any, Any]:
    """``(shard_mesh, replicate_mesh)`` over the world group.

    ``shard_mesh``: 1-D ``(world,)`` for ``extra_dp_size=1``, else the HSDP mesh ``(extra_dp_size,
    world // extra_dp_size)`` (dims ``replicate``, ``shard``): parameters sharded inside groups of
    ``world // extra_dp_size`` ranks, replicated across the ``extra_dp_size`` groups, as Gemini's extra DP group.
    ``replicate_mesh``: ``(world, 1)``: a unit on it is whole on every rank; built only when ``replicate`` (its
    process groups cost a collective set-up), else ``None``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % extra_dp_size != 0:
        raise ValueError(
            f"GeminiPlugin: extra_dp_size={extra_dp_size} does not divide the world size {world}; pick a "
            f"divisor of {world}."
        )
    names = ("replicate", "shard")
    if extra_dp_size == 1:
        shard_mesh = init_device_mesh(device.type, (world,))
    else:
        shard_mesh = init_device_mesh(
            device.type, (extra_dp_size, world // extra_dp_size), mesh_dim_names=names
        )
    replicate_mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=names) if replicate else None
    return shard_mesh, replicate_mesh
