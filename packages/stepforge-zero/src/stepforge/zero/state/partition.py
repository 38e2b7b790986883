# SPDX-License-Identifier: Apache-2.0
"""How a working parameter is split over the data-parallel ranks, and the rank's shard of it.

Every parameter is flattened and cut as ``torch.chunk`` cuts its ``numel`` ``n`` into ``W`` pieces: piece size
``s = ceil(n / W)``, rank ``r`` owns ``[r*s, min((r+1)*s, n))`` (possibly empty), saved and resharded by DCP in the
parameter's shape as a :class:`stepforge.core.flat_shard.FlatShard` (:mod:`.dicts`). On the wire each piece is
zero-padded to ``s``. Slots are grouped into *partitions*, one per (param group, working dtype), gathered after a
step. :func:`build_layout` over ``meta`` parameters allocates nothing (the memory plan uses that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Slot",
    "Partition",
    "ShardLayout",
    "piece_size",
    "padding",
    "local_range",
    "managed_param_groups",
    "build_layout",
]


def piece_size(numel: int, world_size: int) -> int:
    """``ceil(numel / world_size)``: the padded per-rank piece of a parameter with ``numel`` elements."""
    return -(-numel // world_size)


def padding(numel: int, world_size: int) -> int:
    """Zeros that pad a flat parameter of ``numel`` elements to ``world_size`` equal pieces (at most
    ``world_size - 1``)."""
    return piece_size(numel, world_size) * world_size - numel


def local_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s piece of a flat tensor of ``numel`` elements (``torch.chunk`` layout)."""
    size = piece_size(numel, world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def managed_param_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` with only the parameters that require grad (a new list of new dicts): frozen ones (a
    LoRA model's base weights) get no master, no gradient piece, no state and no gather, as in ColossalAI."""
    return [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups]


@dataclass(eq=False)
class Slot:
    """One working parameter and this rank's shard of it.

    Attributes:
        index: global parameter index (order of the param groups, as in ``torch.optim`` state dicts).
        group: index of the param group.
        param: the working (model) parameter.
        numel, piece: its element count and the padded per-rank piece size ``ceil(numel / W)``.
        start, valid: where this rank's piece starts in the flat parameter and its real elements (may be 0).
        master: what the inner optimizer steps (``valid`` elements); ``separate_master`` is ``False`` when it is
            a view into the working parameter (same dtype and device, contiguous: no copy, no checkpoint).
        grad: the reduced (averaged) gradient of the piece, ``valid`` elements in the master dtype, or ``None``.
        offset: where the piece sits inside its partition's flat per-rank buffer.
    """

    index: int
    group: int
    param: torch.Tensor
    numel: int
    piece: int
    start: int
    valid: int
    master: torch.Tensor
    separate_master: bool
    grad: torch.Tensor | None = None
    offset: int = 0


@dataclass(eq=False)
class Partition:
    """All slots of one (param group, working dtype): the unit of the post-step all-gather."""

    group: int
    dtype: torch.dtype
    device: torch.device
    slots: list[Slot] = field(default_factory=list)
    size: int = 0  # per-rank elements: sum of the slots' padded pieces


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """How one optimizer's parameters are sharded (slots in global index order, partitions, the data-parallel
    group, ``None``: the default one), and nothing about the optimizer: the state dicts and the communication take
    this value instead of the optimizer, so the optimizer module depends on them, not the reverse."""

    slots: list[Slot]
    partitions: list[Partition]
    world_size: int
    rank: int
    group: Any = None

    @property
    def master_device(self) -> torch.device:
        """Where the master pieces live (the first slot's; CPU without parameters)."""
        return self.slots[0].master.device if self.slots else torch.device("cpu")

    def group_slots(self, group: int) -> list[Slot]:
        """The slots of param group ``group``, in index order."""
        return [s for s in self.slots if s.group == group]

    def slot_of(self, param: torch.Tensor) -> Slot | None:
        """The slot of working parameter ``param`` (by identity); ``None`` when it is not managed."""
        return next((s for s in self.slots if s.param is param), None)


def build_layout(
    param_groups: list[dict[str, Any]],
    world_size: int,
    rank: int,
    *,
    group: Any,
    master_weights: bool,
    master_device: torch.device | None,
) -> ShardLayout:
    """Slots for every parameter of the working ``param_groups`` (masters allocated: fp32 for fp16/bf16 ones with
    ``master_weights``, on ``master_device``, ``None``: the parameter's own) and the partitions that group them."""
    slots: list[Slot] = []
    by_key: dict[tuple[int, torch.dtype, torch.device], Partition] = {}
    for g, group_ in enumerate(param_groups):
        for param in group_["params"]:
            numel, piece = param.numel(), piece_size(param.numel(), world_size)
            start, stop = local_range(numel, world_size, rank)
            low = master_weights and param.dtype in (torch.float16, torch.bfloat16)
            dtype = torch.float32 if low else param.dtype
            device = master_device if master_device is not None else param.device
            separate = not (param.dtype == dtype and param.device == device and param.is_contiguous())
            flat = param.detach().reshape(-1)[start:stop]
            # not separate: a view, the working parameter is its own master
            master = flat.to(device=device, dtype=dtype, copy=True) if separate else flat
            key = (g, param.dtype, param.device)
            part = by_key.get(key)
            if part is None:
                part = by_key[key] = Partition(g, param.dtype, param.device)
            slot = Slot(
                len(slots), g, param, numel, piece, start, stop - start, master, separate, offset=part.size
            )
            part.size += piece
            part.slots.append(slot)
            slots.append(slot)
    return ShardLayout(slots, list(by_key.values()), world_size, rank, group)
