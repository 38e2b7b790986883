# SPDX-License-Identifier: Apache-2.0
"""The two tensor collectives, under the names the installed torch prefers.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single`` (same signatures); older torch has only the former. They are
looked up at call time so that wrapping ``torch.distributed`` (tests, the benchmark) sees every call.

On top of them: :func:`gather_params` (the updated master pieces into every rank's working parameters: one
all-gather per partition, or broadcasts -- in place for large parameters) and :func:`all_reduce_small` (the one-element reductions of the norm and the
overflow flag).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._partition import ShardLayout, Slot, local_range

__all__ = [
    "all_gather_name",
    "reduce_scatter_name",
    "all_gather",
    "reduce_scatter",
    "gather_by_broadcast",
    "gather_params",
    "DIRECT_MIN",
    "all_reduce_small",
]

all_gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
reduce_scatter_name = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather(output: torch.Tensor, local: torch.Tensor, *, group: Any, async_op: bool = False) -> Any:
    """``output`` (``W * local.numel()``) = every rank's ``local``, rank-major."""
    return getattr(dist, all_gather_name)(output, local, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, flat: torch.Tensor, *, group: Any, async_op: bool = False) -> Any:
    """``output`` = this rank's chunk of the element-wise sum of every rank's ``flat``."""
    return getattr(dist, reduce_scatter_name)(output, flat, group=group, async_op=async_op)


def gather_by_broadcast(local: torch.Tensor, rank: int, world_size: int, *, group: Any) -> torch.Tensor:
    """The ``(world_size, n)`` table of every rank's ``local`` (``n`` elements), one broadcast per rank."""
    table = torch.empty((world_size, local.numel()), dtype=local.dtype, device=local.device)
    table[rank].copy_(local)
    for src in range(world_size):
        source = src if group is None else dist.get_global_rank(group, src)
        dist.broadcast(table[src], src=source, group=group)
    return table


#: parameters with at least this many elements are gathered by ``"broadcast"`` in place: each rank's piece is
#: broadcast straight from and into the working parameter's own memory (no staging buffer, no copy back)
DIRECT_MIN = 1 << 16


def _source(src: int, group: Any) -> int:
    return src if group is None else dist.get_global_rank(group, src)


@torch.no_grad()
def gather_params(layout: ShardLayout, method: str, *, direct_min: int = DIRECT_MIN) -> None:
    """Copy every rank's master pieces into the working parameters of every rank.

    ``method="all_gather"``: per partition one ``all_gather`` of the padded per-rank buffer.
    ``method="broadcast"``: every contiguous parameter of at least ``direct_min`` elements gets one broadcast
    per rank of that rank's piece, in place in the parameter (the owner first writes a separate master into
    its piece); the smaller ones of a partition are staged into one buffer and gathered by one broadcast per
    rank. All broadcasts are launched asynchronously and waited for together, so gloo's workers pipeline
    them. With one rank a local copy.
    """
    world, group = layout.world_size, layout.group
    pending: list[tuple[Any, Any]] = []  # (work, what to do once it finished)
    for part in layout.partitions:
        slots = part.slots
        if world > 1 and method == "broadcast":
            direct = [s for s in slots if s.numel >= direct_min and s.param.is_contiguous()]
            for slot in direct:
                flat = slot.param.detach().view(-1)
                if slot.separate_master and slot.valid:
                    flat[slot.start : slot.start + slot.valid].copy_(slot.master)
                for src in range(world):
                    start, stop = local_range(slot.numel, world, src)
                    if stop > start:
                        work = dist.broadcast(
                            flat[start:stop], src=_source(src, group), group=group, async_op=True
                        )
                        pending.append((work, None))
            slots = [s for s in slots if not any(s is d for d in direct)]
            if not slots:
                continue
        size = sum(s.piece for s in slots)
        offsets = [sum(s.piece for s in slots[:i]) for i in range(len(slots))] if slots else []
        local = torch.zeros(size, dtype=part.dtype, device=part.device)
        for slot, offset in zip(slots, offsets, strict=True):
            if slot.valid:
                local[offset : offset + slot.valid].copy_(slot.master)
        if world == 1:
            _scatter_table(local.view(1, size), slots, offsets)
        elif method == "broadcast":
            table = torch.empty((world, size), dtype=part.dtype, device=part.device)
            table[layout.rank].copy_(local)
            works = [
                dist.broadcast(table[src], src=_source(src, group), group=group, async_op=True)
                for src in range(world)
            ]
            pending.extend((w, None) for w in works[:-1])
            pending.append((works[-1], (table, slots, offsets)))
        else:
            table = torch.empty((world, size), dtype=part.dtype, device=part.device)
            all_gather(table.view(-1), local, group=group)
            _scatter_table(table, slots, offsets)
    for work, _ in pending:
        work.wait()
    for _, then in pending:
        if then is not None:
            _scatter_table(*then)


def _scatter_table(table: torch.Tensor, slots: list[Slot], offsets: list[int]) -> None:
    for slot, offset in zip(slots, offsets, strict=True):
        full = table[:, offset : offset + slot.piece].reshape(-1)[: slot.numel]
        slot.param.copy_(full.view_as(slot.param))


def all_reduce_small(value: torch.Tensor, op: Any, layout: ShardLayout, device: torch.device) -> torch.Tensor:
    """All-reduce a few elements on ``device`` (where the backend wants them); the result on the CPU."""
    if layout.world_size > 1:
        value = value.to(device)
        dist.all_reduce(value, op=op, group=layout.group)
    return value.cpu()
