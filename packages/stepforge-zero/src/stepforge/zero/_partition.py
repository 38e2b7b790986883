# SPDX-License-Identifier: Apache-2.0
"""How a working parameter is split over the data-parallel ranks, and the rank's shard of it.

Every parameter is flattened and cut the way ``torch.chunk`` cuts a 1-D tensor of its ``numel`` ``n`` into
``W`` pieces: piece size ``s = ceil(n / W)``, rank ``r`` owns ``[r*s, min((r+1)*s, n))`` (possibly empty for
the last ranks of a tiny parameter). That is exactly the local piece of a 1-D ``DTensor`` with ``Shard(0)``
over ``W`` ranks, so the sharded state is saved and resharded by ``torch.distributed.checkpoint`` without any
gathering. For communication each piece is zero-padded to ``s`` so that every rank contributes the same
number of elements (at most ``W - 1`` padding elements per parameter).

Slots are grouped into *partitions*: one per (param group, working dtype); after a step each partition is
all-gathered with a single collective.
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
    "local_range",
    "build_partitions",
    "build_layout",
    "padded_piece",
]


def piece_size(numel: int, world_size: int) -> int:
    """``ceil(numel / world_size)``: the padded per-rank piece of a parameter with ``numel`` elements."""
    return -(-numel // world_size)


def local_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s piece of a flat tensor of ``numel`` elements (``torch.chunk`` layout)."""
    size = piece_size(numel, world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


@dataclass(eq=False)
class Slot:
    """One working parameter and this rank's shard of it.

    Attributes:
        index: global parameter index (order of the param groups, as in ``torch.optim`` state dicts).
        group: index of the param group.
        param: the working (model) parameter.
        numel, piece: its element count and the padded per-rank piece size ``ceil(numel / W)``.
        start, valid: where this rank's piece starts in the flat parameter and how many of its elements are
            real (``piece - valid`` trailing padding; ``valid`` may be 0).
        master: the tensor the inner optimizer steps, ``valid`` elements on the master device; for a working
            dtype equal to the master dtype on the same device it is a view into the working parameter.
        grad: the reduced (averaged) gradient of the piece, ``valid`` elements in the master dtype, or ``None``.
        separate_master: ``False`` when ``master`` is a view into the working parameter (same dtype and
            device, contiguous): the working parameter is then its own master and needs no copy or checkpoint.
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
    """Everything about how one optimizer's parameters are sharded, and nothing about the optimizer.

    The state-dict functions (:mod:`._full_state`, :mod:`._sharded_state`) take this value instead of the
    optimizer, so they depend on the layout only and the optimizer module depends on them, not the reverse.

    Attributes:
        slots: every working parameter's :class:`Slot`, in global parameter index order.
        partitions: the slots grouped per (param group, working dtype, device).
        world_size, rank: the data-parallel group's size and this process's rank in it.
        group: the data-parallel process group (``None``: the default group, or no group at one rank).
    """

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


def _make_master(
    param: torch.Tensor, start: int, stop: int, master_dtype: torch.dtype, master_device: torch.device
) -> tuple[torch.Tensor, bool]:
    if param.dtype == master_dtype and param.device == master_device and param.is_contiguous():
        return param.detach().view(-1)[start:stop], False  # the working parameter is its own master
    piece = param.detach().reshape(-1)[start:stop]
    return piece.to(device=master_device, dtype=master_dtype, copy=True), True


def build_partitions(
    param_groups: list[dict[str, Any]],
    world_size: int,
    rank: int,
    *,
    master_weights: bool,
    master_device: torch.device | None,
) -> tuple[list[Slot], list[Partition]]:
    """Slots for every parameter of ``param_groups`` and the partitions that group them.

    Args:
        param_groups: the working param groups (dicts with a ``"params"`` list).
        world_size, rank: the data-parallel group.
        master_weights: keep fp32 masters for lower-precision working params (else the master is the
            working dtype).
        master_device: ``torch.device("cpu")`` for CPU offload, ``None`` for the parameter's own device.
    """
    slots: list[Slot] = []
    partitions: list[Partition] = []
    index = 0
    for g, group in enumerate(param_groups):
        by_dtype: dict[tuple[torch.dtype, torch.device], Partition] = {}
        for param in group["params"]:
            numel = param.numel()
            piece = piece_size(numel, world_size)
            start, stop = local_range(numel, world_size, rank)
            if master_weights and param.dtype in (torch.float16, torch.bfloat16):
                master_dtype = torch.float32
            else:
                master_dtype = param.dtype
            device = master_device if master_device is not None else param.device
            master, separate = _make_master(param, start, stop, master_dtype, device)
            slot = Slot(index, g, param, numel, piece, start, stop - start, master, separate)
            key = (param.dtype, param.device)
            part = by_dtype.get(key)
            if part is None:
                part = by_dtype[key] = Partition(g, param.dtype, param.device)
                partitions.append(part)
            slot.offset = part.size
            part.size += piece
            part.slots.append(slot)
            slots.append(slot)
            index += 1
    return slots, partitions


def padded_piece(flat: torch.Tensor, piece: int, world_size: int) -> torch.Tensor:
    """``flat`` zero-padded to ``piece * world_size`` elements and viewed as ``(world_size, piece)``."""
    missing = piece * world_size - flat.numel()
    if missing:
        flat = torch.cat([flat, flat.new_zeros(missing)])
    return flat.view(world_size, piece)


def build_layout(
    param_groups: list[dict[str, Any]],
    world_size: int,
    rank: int,
    *,
    group: Any,
    master_weights: bool,
    master_device: torch.device | None,
) -> ShardLayout:
    """:func:`build_partitions` packed with the group facts into a :class:`ShardLayout`."""
    slots, partitions = build_partitions(
        param_groups, world_size, rank, master_weights=master_weights, master_device=master_device
    )
    return ShardLayout(slots, partitions, world_size, rank, group)
