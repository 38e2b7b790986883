# SPDX-License-Identifier: Apache-2.0
"""``stepforge.zero.state.partition``: the ``torch.chunk`` piece layout, slots, partitions and masters (one
process), and the same geometry planned without allocating (parameters on the ``meta`` device)."""

from __future__ import annotations

import pytest
import torch

from stepforge.zero.state.partition import (
    ShardLayout,
    build_layout,
    local_range,
    managed_param_groups,
    padding,
    piece_size,
)


def build_partitions(groups, world, rank, **kw):
    layout = build_layout(groups, world, rank, group=None, **kw)
    return layout.slots, layout.partitions


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_pieces_are_torch_chunk_of_the_flat_parameter(world):
    for numel in range(0, 23):
        flat = torch.arange(numel)
        chunks = list(flat.chunk(world)) if numel else []
        covered = []
        for rank in range(world):
            start, stop = local_range(numel, world, rank)
            assert 0 <= start <= stop <= numel
            assert stop - start <= piece_size(numel, world)
            want = chunks[rank] if rank < len(chunks) else flat[:0]  # chunk drops trailing empty pieces
            assert torch.equal(flat[start:stop], want), (numel, world, rank)
            covered.extend(range(start, stop))
        assert covered == list(range(numel))  # disjoint, in order, complete


def test_piece_size_is_the_ceiling():
    assert [piece_size(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def _groups() -> list[dict]:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3))  # 15 elements
    b = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
    c = torch.nn.Parameter(torch.randn(2))  # 2 elements: empty pieces for ranks 2, 3 at world 4
    d = torch.nn.Parameter(torch.randn(7))
    return [{"params": [a, b, c]}, {"params": [d], "lr": 0.1}]


def test_slots_partitions_and_offsets_at_four_ranks():
    groups = _groups()
    slots, parts = build_partitions(groups, 4, 3, master_weights=True, master_device=None)
    assert [s.index for s in slots] == [0, 1, 2, 3]
    assert [s.group for s in slots] == [0, 0, 0, 1]
    assert [(s.numel, s.piece) for s in slots] == [(15, 4), (4, 1), (2, 1), (7, 2)]
    # rank 3's ranges: a [12, 15), b [3, 4), c empty, d [6, 7)
    assert [(s.start, s.valid) for s in slots] == [(12, 3), (3, 1), (2, 0), (6, 1)]
    # one partition per (group, dtype): group 0 fp32 {a, c}, group 0 bf16 {b}, group 1 fp32 {d}
    assert [(p.group, p.dtype, [s.index for s in p.slots]) for p in parts] == [
        (0, torch.float32, [0, 2]),
        (0, torch.bfloat16, [1]),
        (1, torch.float32, [3]),
    ]
    a_slot, b_slot, c_slot, d_slot = slots
    assert (a_slot.offset, c_slot.offset, parts[0].size) == (0, 4, 5)  # padded pieces side by side
    assert (b_slot.offset, parts[1].size, d_slot.offset, parts[2].size) == (0, 1, 0, 2)


def test_fp32_master_is_a_view_and_low_precision_gets_an_fp32_copy():
    groups = _groups()
    slots, _ = build_partitions(groups, 2, 0, master_weights=True, master_device=None)
    a_slot, b_slot = slots[0], slots[1]
    assert not a_slot.separate_master
    a_slot.master.fill_(7.0)  # writes through to the working parameter's first 8 elements
    assert torch.equal(groups[0]["params"][0].detach().reshape(-1)[:8], torch.full((8,), 7.0))
    assert b_slot.separate_master and b_slot.master.dtype == torch.float32
    assert torch.equal(b_slot.master, groups[0]["params"][1].detach().float()[:2])
    b_slot.master.fill_(1.0)  # a copy: the working parameter is untouched
    assert not torch.equal(groups[0]["params"][1].detach().float()[:2], torch.ones(2))


def test_without_master_weights_the_working_dtype_is_stepped():
    slots, _ = build_partitions(_groups(), 2, 1, master_weights=False, master_device=None)
    assert slots[1].master.dtype == torch.bfloat16 and not slots[1].separate_master


def test_offload_puts_every_master_on_the_cpu_as_a_copy():
    slots, _ = build_partitions(_groups(), 2, 0, master_weights=True, master_device=torch.device("cpu"))
    assert all(s.master.device.type == "cpu" for s in slots)
    # fp32 on the CPU already: still a view (same device and dtype), nothing to copy
    assert not slots[0].separate_master


def test_layout_packs_the_group_facts():
    groups = _groups()
    layout = build_layout(groups, 2, 1, group=None, master_weights=True, master_device=None)
    assert isinstance(layout, ShardLayout)
    assert (layout.world_size, layout.rank, layout.group) == (2, 1, None)
    assert [s.index for s in layout.group_slots(0)] == [0, 1, 2]
    assert [s.index for s in layout.group_slots(1)] == [3]
    assert layout.master_device == torch.device("cpu")
    empty = build_layout([{"params": []}], 1, 0, group=None, master_weights=True, master_device=None)
    assert empty.slots == [] and empty.master_device == torch.device("cpu")


def test_padding_fills_the_last_piece():
    # world 4: 15 -> pieces of 4, 16 padded; 16 -> none; 2 -> pieces of 1, 4 padded
    assert [padding(n, 4) for n in (15, 16, 2, 0)] == [1, 0, 2, 0]


def _meta_groups() -> list[dict]:
    with torch.device("meta"):
        return [
            {"params": [torch.nn.Parameter(torch.empty(5, 3)), torch.nn.Parameter(torch.empty(4, dtype=torch.bfloat16)),
                        torch.nn.Parameter(torch.empty(2))]},
            {"params": [torch.nn.Parameter(torch.empty(7))], "lr": 0.1},
        ]  # fmt: skip


@pytest.mark.parametrize("rank", [0, 3])
def test_layout_on_the_meta_device_is_the_geometry_that_is_then_allocated(rank):
    plans, plan_parts = build_partitions(_meta_groups(), 4, rank, master_weights=True, master_device=None)
    slots, parts = build_partitions(_groups(), 4, rank, master_weights=True, master_device=None)
    assert [
        (p.index, p.group, p.numel, p.piece, p.start, p.valid, p.offset, p.separate_master) for p in plans
    ] == [(s.index, s.group, s.numel, s.piece, s.start, s.valid, s.offset, s.separate_master) for s in slots]
    assert [p.master.dtype for p in plans] == [torch.float32] * 4  # bf16 gets an fp32 master
    assert [p.size for p in plan_parts] == [p.size for p in parts] == [5, 1, 2]
    assert all(p.master.device.type == "meta" for p in plans)  # nothing was made on a real device


def test_only_parameters_that_require_grad_are_managed():
    groups = _groups()
    frozen = groups[0]["params"][1].requires_grad_(False)
    managed = managed_param_groups(groups)
    assert [len(g["params"]) for g in managed] == [2, 1] and all(
        p is not frozen for p in managed[0]["params"]
    )
    assert managed[1]["lr"] == 0.1 and len(groups[0]["params"]) == 3  # a new list; the input is left alone
