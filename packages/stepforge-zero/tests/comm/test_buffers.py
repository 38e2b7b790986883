# SPDX-License-Identifier: Apache-2.0
"""``stepforge.zero.comm.buffers``: the reduced pieces and the bucket buffers are allocated once and reused from
step to step, within a bounded number of buffers."""

from __future__ import annotations

import torch

from stepforge.zero.comm.buffers import BufferPool, PieceStore
from stepforge.zero.comm.grad_reducer import MAX_IN_FLIGHT, GradReducer
from stepforge.zero.state.partition import build_layout


def test_pool_reuses_a_given_back_buffer_and_keeps_at_most_keep():
    pool = BufferPool(keep=2, min_numel=8)
    first = pool.take(5, torch.float32, torch.device("cpu"))
    assert first.numel() == 8  # at least min_numel
    pool.give(first)
    again = pool.take(6, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == first.data_ptr()
    other_dtype = pool.take(6, torch.float64, torch.device("cpu"))
    assert other_dtype.data_ptr() != first.data_ptr() and other_dtype.dtype == torch.float64
    big = pool.take(100, torch.float32, torch.device("cpu"))
    assert big.numel() == 100
    for buffer in (again, other_dtype, big):
        pool.give(buffer)
    # three handed back, two kept: the smallest (8 float32 elements = 32 bytes) was dropped
    assert pool.held_bytes == 100 * 4 + 8 * 8
    pool.clear()
    assert pool.held_bytes == 0


def _slots(world: int = 1, rank: int = 0, dtype: torch.dtype = torch.float32):
    params = [torch.nn.Parameter(torch.randn(3, 2).to(dtype)), torch.nn.Parameter(torch.randn(5).to(dtype))]
    slots = build_layout(
        [{"params": params}], world, rank, group=None, master_weights=True, master_device=None
    ).slots
    return params, slots


def test_piece_store_hands_out_disjoint_views_of_one_flat_tensor_per_master_dtype():
    _, slots = _slots(world=2, rank=1, dtype=torch.bfloat16)  # fp32 masters of bf16 params
    store = PieceStore(slots)
    assert store.held_bytes == 0  # allocated with the first request
    views = [store.view(s) for s in slots]
    assert [v.numel() for v in views] == [s.valid for s in slots] == [3, 2]
    assert all(v.dtype == torch.float32 for v in views)
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()
    assert views[1].data_ptr() == views[0].data_ptr() + 3 * 4
    assert store.held_bytes == 5 * 4


def test_reducer_reuses_the_piece_storage_after_zero_grad():
    params, slots = _slots()
    reducer = GradReducer(
        slots, stage=2, bucket_size=1 << 20, overlap=False, group=None, world_size=1, rank=0
    )
    sum((p * (i + 1)).sum() for i, p in enumerate(params)).backward()
    reducer.sync()
    first = [s.grad.data_ptr() for s in slots]
    assert torch.equal(slots[1].grad, torch.full((5,), 2.0))
    reducer.discard()
    for slot in slots:
        slot.grad = None  # zero_grad(set_to_none=True)
    sum((p * 3.0).sum() for p in params).backward()
    reducer.sync()
    assert [s.grad.data_ptr() for s in slots] == first  # same memory, new values
    assert torch.equal(slots[0].grad, torch.full((6,), 3.0))
    assert reducer.pool.held_bytes <= (MAX_IN_FLIGHT + 1) * 11 * 4


def test_pool_drops_the_smallest_buffer_wherever_it_sits():
    pool = BufferPool(keep=2, min_numel=1)
    cpu = torch.device("cpu")
    big, bigger, small = (pool.take(n, torch.float32, cpu) for n in (50, 70, 5))
    for buffer in (big, bigger, small):  # the smallest last: found by identity, never by comparing elements
        pool.give(buffer)
    assert pool.held_bytes == (50 + 70) * 4
