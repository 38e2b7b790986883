# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's ``extra_dp_group``: ZeRO over the 2-D grid that ``extra_dp_group`` x ``dp_process_group`` span.

ColossalAI shards over the product of the two groups (rank ``extra_rank * dp_size + dp_rank``) with two
hierarchical collectives; the pieces and sums are those of one group over the grid's ranks, so stepforge builds
that group (global ranks sorted: ColossalAI's order for ``LowLevelZeroPlugin(extra_dp_size=...)``'s grid) and runs
one flat collective. Building it is collective over the default group (one ``all_gather_object`` of each rank's
two groups, then every grid created in the same order everywhere, as ``new_group`` requires).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from stepforge.core import HyperParameterError

__all__ = ["grid_group"]


def grid_group(extra_dp_group: Any, dp_process_group: Any) -> Any:
    """The process group over every rank of this rank's grid (``None``: the grid is the whole default group).

    Raises:
        HyperParameterError: the two groups do not span a full grid (its size is not their sizes' product).
    """
    extra = dist.get_process_group_ranks(extra_dp_group)
    inner = dist.get_process_group_ranks(dp_process_group)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (extra, inner))
    parent: dict[int, int] = {}  # union-find: ranks connected by sharing an extra or an inner group

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for members in (list(extra_) + list(inner_) for extra_, inner_ in everyone):
        for other in members[1:]:
            parent[find(other)] = find(members[0])
    components: dict[int, set[int]] = {}
    for member in parent:
        components.setdefault(find(member), set()).add(member)
    grids = sorted((frozenset(g) for g in components.values()), key=min)
    rank = dist.get_rank()
    mine = next(g for g in grids if rank in g)
    if len(mine) != len(extra) * len(inner) or set(extra) & set(inner) != {rank}:
        raise HyperParameterError(
            f"LowLevelZeroOptimizer: extra_dp_group (ranks {extra}) and dp_process_group (ranks {inner}) must "
            f"span a 2-D grid (every rank in one extra and one inner group, meeting only in itself); the ranks "
            f"connected to rank {rank} are {sorted(mine)} ({len(mine)} != {len(extra)} x {len(inner)})."
        )
    if len(mine) == dist.get_world_size():
        return None
    chosen = None
    for grid in grids:  # same order on every rank: new_group is collective over the default group
        group = dist.new_group(sorted(grid))
        if rank in grid:
            chosen = group
    return chosen
