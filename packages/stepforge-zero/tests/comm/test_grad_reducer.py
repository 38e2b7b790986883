# SPDX-License-Identifier: Apache-2.0
"""``stepforge.zero.comm.grad_reducer.GradReducer``: hooks, buckets, the once-per-step sync and the rank-major
reduction.

One process (world size 1: no collective, the bucket lands in the pieces directly) for the hook and sync logic;
2 gloo ranks for the reduction itself, against the mean of the ranks' gradients computed by hand.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.zero.comm.grad_reducer import MAX_IN_FLIGHT, GradReducer
from stepforge.zero.state.partition import build_layout


def _reducer(params: list[torch.nn.Parameter], *, world: int = 1, rank: int = 0, stage: int = 2, **kw):
    slots = build_layout(
        [{"params": params}], world, rank, group=None, master_weights=True, master_device=None
    ).slots
    options = dict(bucket_size=1 << 20, overlap=False, group=None, world_size=world, rank=rank)
    options.update(kw)
    return slots, GradReducer(slots, stage=stage, **options)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]


def _backward(params: list[torch.nn.Parameter], factor: float) -> None:
    sum((p * factor * (i + 1)).sum() for i, p in enumerate(params)).backward()


def test_the_reducers_pool_buffers_are_the_planned_size():
    params = _params()  # 6 and 4 elements: pieces of 6 and 4 at one rank
    _, reducer = _reducer(params, bucket_size=8)
    assert reducer.pool.min_numel == 8  # a bucket
    _, reducer = _reducer(_params(), bucket_size=100)
    assert reducer.pool.min_numel == 10  # never more than every piece padded


def test_hooks_move_each_gradient_into_its_piece_and_free_param_grad():
    params = _params()
    slots, reducer = _reducer(params)
    _backward(params, 1.0)
    assert all(p.grad is None for p in params)
    assert torch.equal(slots[0].grad, torch.full((6,), 1.0))
    assert torch.equal(slots[1].grad, torch.full((4,), 2.0))
    _backward(params, 0.5)  # a second backward accumulates into the pieces
    assert torch.equal(slots[1].grad, torch.full((4,), 3.0))
    reducer.remove_hooks()
    _backward(params, 1.0)
    assert params[0].grad is not None  # detached: torch's own accumulation again


def test_disabled_reducer_leaves_gradients_local_until_the_sync():
    params = _params()
    slots, reducer = _reducer(params)
    reducer.enabled = False  # no_sync
    _backward(params, 1.0)
    _backward(params, 1.0)
    assert torch.equal(params[0].grad, torch.full((3, 2), 2.0))
    assert all(s.grad is None for s in slots)
    assert reducer.sync() is False and params[0].grad is not None  # inside no_sync the sync only waits
    reducer.enabled = True
    assert reducer.sync() is True
    assert params[0].grad is None and torch.equal(slots[0].grad, torch.full((6,), 2.0))


def test_sync_works_once_until_a_backward_reopens_it():
    params = _params()
    slots, reducer = _reducer(params)
    _backward(params, 1.0)
    assert reducer.sync() is True
    assert reducer.sync() is False and reducer.sync() is False
    assert reducer.counter.syncs == 1
    reducer.enabled = False
    _backward(params, 1.0)  # even a no_sync backward makes the next sync do work (it must flush)
    reducer.enabled = True
    assert reducer.sync() is True and params[0].grad is None
    assert torch.equal(slots[0].grad, torch.full((6,), 2.0))
    reducer.discard()  # zero_grad: the next step starts unsynced
    assert reducer.sync() is True and reducer.counter.syncs == 3


def test_sparse_gradients_are_refused_naming_the_parameter():
    emb = torch.nn.Embedding(5, 2, sparse=True)
    _reducer(list(emb.parameters()))  # the hooks keep the reducer alive
    with pytest.raises(RuntimeError, match="parameter 0 got a sparse gradient"):
        emb(torch.tensor([1, 2])).sum().backward()


# -- the reduction on 2 ranks ------------------------------------------------------------------------------
def _reduce(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 2):
        for overlap in (False, True):
            # 5 and 3 elements: pieces 3 and 2 (6 and 4 padded elements), both padded at 2 ranks; a bucket of 4
            # padded elements closes after either parameter, so two buckets go out whatever the hook order
            params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))]
            slots, reducer = _reducer(
                params, world=world, rank=rank, stage=stage, bucket_size=4, overlap=overlap, group=None
            )
            # rank r's gradient of parameter i: (r + 1) * (i + 1) * [1, 2, ...]
            loss = sum(
                (p * torch.arange(1.0, p.numel() + 1) * (rank + 1) * (i + 1)).sum()
                for i, p in enumerate(params)
            )
            loss.backward()
            reducer.sync()
            counts = reducer.counter
            out[(stage, overlap)] = (
                [None if s.grad is None else s.grad.clone() for s in slots],
                [(s.start, s.valid) for s in slots],
                counts.reduce_scatter,
                counts.all_reduce,
                reducer.peak_in_flight,
            )
    return out


@pytest.mark.distributed
@requires_gloo
def test_two_ranks_receive_their_pieces_of_the_mean_gradient():
    results = run_distributed(_reduce, 2, timeout=120)
    mean_rank_factor = (1 + 2) / 2
    for rank in range(2):
        for (stage, overlap), (grads, ranges, rs, ar, peak) in results[rank].items():
            for i, (grad, (start, valid)) in enumerate(zip(grads, ranges, strict=True)):
                numel = (5, 3)[i]
                full = torch.arange(1.0, numel + 1) * mean_rank_factor * (i + 1)
                torch.testing.assert_close(grad, full[start : start + valid], rtol=0, atol=0)
            assert (rs, ar) == ((2, 0) if stage == 2 else (0, 2)), (stage, overlap)
            # pieces 3 and 2 padded over 2 ranks are 6 and 4 elements: each closes a 4-element bucket alone
            assert rs + ar == 2
            assert peak <= (MAX_IN_FLIGHT + 1) * 6
