# SPDX-License-Identifier: Apache-2.0
"""The parameter gather after a step: every rank's updated master pieces into every rank's working parameters.

:func:`launch_gather` starts the collectives in parameter order (for almost every model the order its forward uses
them), small parameters first in one staged collective; the optimizer waits for the returned
:class:`GatherInFlight` at once (ColossalAI's default) or, with ``overlap_allgather``, lets each module's next
forward wait for its own parameters only (:meth:`GatherInFlight.wait_in_forward`, a global forward pre-hook).

Methods (``LowLevelZeroOptimizer(param_gather=...)``): ``"broadcast"`` broadcasts each rank's piece of every
contiguous parameter of at least ``direct_min`` elements in place, and the smaller ones staged in one table per
partition (gloo's broadcast is several times faster than its all-gather on the CPU); ``"all_gather"`` all-gathers
each partition's padded pieces (per chunk of about ``chunk`` elements when overlapped, so the first lands first).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook

from ..state.partition import Partition, ShardLayout, Slot, local_range
from .grad_reducer import all_gather

__all__ = [
    "DIRECT_MIN",
    "GATHER_CHUNK",
    "GatherInFlight",
    "StagingBuffers",
    "launch_gather",
    "split_direct",
]

#: parameters with at least this many elements are gathered by ``"broadcast"`` in place: each rank's piece is
#: broadcast straight from and into the working parameter's own memory (no staging buffer, no copy back). Smaller
#: ones are staged in a table kept between steps: below about 4 MiB a broadcast pair's fixed cost on gloo outweighs
#: the copy in and out (tools/bench/zero/bench_gather.py: the demo GPT's gather, every parameter below this, takes
#: 1.65x the floor of two bare broadcasts); on the 54.6 M-parameter bench GPT moving this from 256 Ki changed
#: nothing measurable (zero2 at 2 ranks, steps timed back to back: 494 ms at 1 Mi, 489 at 256 Ki) and keeps 48 MiB of tables
DIRECT_MIN = 1 << 20
#: per-rank elements of one all-gather when the gather is overlapped with the next forward
GATHER_CHUNK = 1 << 22


@dataclass(eq=False)
class _Entry:
    """Collectives carrying some parameters, and what to run once they finished (copy a staged table out)."""

    works: list[Any]
    params: list[torch.Tensor]
    then: Callable[[], None] | None = None
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        for work in self.works:
            work.wait()
        if self.then is not None:
            with torch.no_grad():
                self.then()
        self.done = True


@dataclass(eq=False)
class GatherInFlight:
    """The collectives of one parameter gather, waited for per parameter or all at once."""

    entries: list[_Entry] = field(default_factory=list)
    _by_param: dict[int, list[_Entry]] = field(default_factory=dict)
    _hook: Any = None

    def add(self, entry: _Entry) -> None:
        self.entries.append(entry)
        for param in entry.params:
            self._by_param.setdefault(id(param), []).append(entry)

    @property
    def done(self) -> bool:
        """Whether every collective finished and every parameter holds its updated values."""
        return all(e.done for e in self.entries)

    @property
    def waiting_in_forward(self) -> bool:
        """Whether the forward pre-hook of :meth:`wait_in_forward` is installed."""
        return self._hook is not None

    def wait_all(self) -> None:
        """Wait for everything, in launch order, and remove the forward hook."""
        for entry in self.entries:
            entry.wait()
        self._remove_hook()

    def wait_in_forward(self) -> None:
        """Let each module's forward wait for its own parameters (a hook removed once everything arrived)."""
        if self.done:
            return

        def before_forward(module: torch.nn.Module, args: Any) -> None:
            for param in module.parameters(recurse=False):  # other parameters may still be on the wire
                for entry in self._by_param.get(id(param), ()):
                    entry.wait()
            if self.done:
                self._remove_hook()

        self._hook = register_module_forward_pre_hook(before_forward)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _source(src: int, group: Any) -> int:
    return src if group is None else dist.get_global_rank(group, src)


class StagingBuffers:
    """The staged gathers' tables (``(world, n)``: row ``r`` holds rank ``r``'s padded pieces of one chunk), kept
    from step to step: allocated every step they cost a page fault per 4 KiB on the CPU; kept, their bytes
    (:attr:`held_bytes`) beside the 1/N shards. The optimizer waits for a gather before it launches the next."""

    def __init__(self) -> None:
        self._tables: dict[tuple[int, int], torch.Tensor] = {}

    def table(self, key: tuple[int, int], world: int, numel: int, part: Partition) -> torch.Tensor:
        """The ``(world, numel)`` table of chunk ``key`` of ``part`` (zero-filled when first made, so the padding
        that is never written stays zero)."""
        table = self._tables.get(key)
        if table is None or table.shape != (world, numel):
            table = torch.zeros((world, numel), dtype=part.dtype, device=part.device)
            self._tables[key] = table
        return table

    def clear(self) -> None:
        """Drop every table (the optimizer was closed)."""
        self._tables.clear()

    @property
    def held_bytes(self) -> int:
        """Bytes of the tables held."""
        return sum(t.numel() * t.element_size() for t in self._tables.values())


def _scatter_table(table: torch.Tensor, slots: list[Slot], offsets: list[int], rank: int) -> None:
    """Every rank's row of ``table`` into the working parameters, in place (no temporary for a contiguous
    parameter). This rank's own piece is skipped where the master is a view into the parameter: the step already
    wrote it there."""
    world = table.shape[0]
    for slot, offset in zip(slots, offsets, strict=True):
        if slot.numel == 0:
            continue
        columns = table[:, offset : offset + slot.piece]
        if not slot.param.is_contiguous():
            slot.param.copy_(columns.reshape(-1)[: slot.numel].view_as(slot.param))
            continue
        # the pieces lie in rank order in the flat parameter: the whole ones are one strided copy and a last short
        # one another, at most two copies at any world size (a copy per rank was 100 000s a step at 1024 ranks)
        flat, piece = slot.param.view(-1), slot.piece
        whole, rest = divmod(slot.numel, piece)
        for first, stop in ((0, world),) if slot.separate_master else ((0, rank), (rank + 1, world)):
            end = min(stop, whole)
            if end > first:
                flat[first * piece : end * piece].view(end - first, piece).copy_(columns[first:end])
            if rest and first <= whole < stop:
                flat[whole * piece :].copy_(columns[whole, :rest])


def _launch_staged(
    layout: ShardLayout,
    part: Partition,
    slots: list[Slot],
    method: str,
    staging: StagingBuffers,
    key: tuple[int, int],
) -> _Entry:
    world, group = layout.world_size, layout.group
    # each padded piece's place in a row of the table, and the row's length
    *offsets, size = itertools.accumulate((s.piece for s in slots), initial=0)
    table = staging.table(key, world, size, part)
    # this rank's updated pieces into its row (a copy for all_gather, whose input may not alias its output)
    local = table[layout.rank] if method == "broadcast" else table[layout.rank].clone()
    for slot, offset in zip(slots, offsets, strict=True):
        if slot.valid:  # the padding is left as it is: never read back
            local[offset : offset + slot.valid].copy_(slot.master)
    if method == "broadcast":
        works = [
            dist.broadcast(table[src], src=_source(src, group), group=group, async_op=True)
            for src in range(world)
        ]
    else:
        works = [all_gather(table.view(-1), local, group=group, async_op=True)]
    return _Entry(
        works, [s.param for s in slots], then=lambda: _scatter_table(table, slots, offsets, layout.rank)
    )


def _launch_direct(layout: ShardLayout, slot: Slot) -> _Entry:
    world, group = layout.world_size, layout.group
    flat = slot.param.detach().view(-1)
    if slot.separate_master and slot.valid:
        flat[slot.start : slot.start + slot.valid].copy_(slot.master)
    works = []
    for src in range(world):
        start, stop = local_range(slot.numel, world, src)
        if stop > start:
            works.append(
                dist.broadcast(flat[start:stop], src=_source(src, group), group=group, async_op=True)
            )
    return _Entry(works, [slot.param])


def split_direct(slots: list[Slot], direct_min: int) -> tuple[list[Slot], list[Slot]]:
    """``(direct, staged)``: the slots ``"broadcast"`` gathers in place (contiguous, at least ``direct_min``
    elements) and those it stages in a table, in order (also read by the memory plan)."""
    direct: list[Slot] = []
    staged: list[Slot] = []
    for slot in slots:
        (direct if slot.numel >= direct_min and slot.param.is_contiguous() else staged).append(slot)
    return direct, staged


def _chunks(slots: list[Slot], chunk: int | None) -> list[list[Slot]]:
    if chunk is None:
        return [slots] if slots else []
    out: list[list[Slot]] = []
    size = 0
    for slot in slots:
        if not out or size + slot.piece > chunk:
            out.append([])
            size = 0
        out[-1].append(slot)
        size += slot.piece
    return out


@torch.no_grad()
def launch_gather(
    layout: ShardLayout,
    method: str,
    *,
    direct_min: int = DIRECT_MIN,
    chunk: int | None = None,
    staging: StagingBuffers | None = None,
) -> GatherInFlight:
    """Start gathering every rank's master pieces into the working parameters by ``method`` (see the module
    docstring): ``chunk`` per-rank elements per staged collective (``None``: one per partition), ``"broadcast"``'s
    tables kept in ``staging`` (``"all_gather"``'s hold whole partitions and are always fresh: kept, they would
    cost a copy of the parameters between steps)."""
    flight = GatherInFlight()
    if layout.world_size == 1:
        for slot in layout.slots:  # nothing to exchange: the masters are the whole parameters
            if slot.separate_master and slot.valid:
                slot.param.copy_(slot.master.view(slot.param.shape))
        return flight
    if staging is None or method != "broadcast":
        staging = StagingBuffers()

    for p, part in enumerate(layout.partitions):
        if method == "broadcast":
            direct, staged = split_direct(part.slots, direct_min)
            # the small ones first (in chunks when overlapped): short collectives that the first layers wait for
            for c, slots in enumerate(_chunks(staged, chunk)):
                flight.add(_launch_staged(layout, part, slots, method, staging, (p, c)))
            for slot in direct:
                flight.add(_launch_direct(layout, slot))
        else:
            for c, slots in enumerate(_chunks(part.slots, chunk)):
                flight.add(_launch_staged(layout, part, slots, method, staging, (p, c)))
    return flight
