# SPDX-License-Identifier: Apache-2.0
"""The two tensor collectives, under the names the installed torch prefers.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single`` (same signatures); older torch has only the former. They are
looked up at call time so that wrapping ``torch.distributed`` (tests, the benchmark) sees every call.

On top of them: :func:`gather_params` (the updated master pieces into every rank's working parameters, one
collective per partition) and :func:`all_reduce_small` (the one-element reductions of the norm and the
overflow flag).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._partition import ShardLayout

__all__ = [
    "all_gather_name",
    "reduce_scatter_name",
    "all_gather",
    "reduce_scatter",
    "gather_by_broadcast",
    "gather_params",
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


@torch.no_grad()
def gather_params(layout: ShardLayout, method: str) -> None:
    """Copy every rank's master pieces into the working parameters of every rank.

    Per partition one ``all_gather`` (``method="all_gather"``) or ``world_size`` broadcasts
    (``"broadcast"``) of the padded per-rank buffer; with one rank a local copy.
    """
    for part in layout.partitions:
        local = torch.zeros(part.size, dtype=part.dtype, device=part.device)
        for slot in part.slots:
            if slot.valid:
                local[slot.offset : slot.offset + slot.valid].copy_(slot.master)
        if layout.world_size == 1:
            table = local.view(1, part.size)
        elif method == "broadcast":
            table = gather_by_broadcast(local, layout.rank, layout.world_size, group=layout.group)
        else:
            table = torch.empty((layout.world_size, part.size), dtype=part.dtype, device=part.device)
            all_gather(table.view(-1), local, group=layout.group)
        for slot in part.slots:
            full = table[:, slot.offset : slot.offset + slot.piece].reshape(-1)[: slot.numel]
            slot.param.copy_(full.view_as(slot.param))


def all_reduce_small(value: torch.Tensor, op: Any, layout: ShardLayout, device: torch.device) -> torch.Tensor:
    """All-reduce a few elements on ``device`` (where the backend wants them); the result on the CPU."""
    if layout.world_size > 1:
        value = value.to(device)
        dist.all_reduce(value, op=op, group=layout.group)
    return value.cpu()
