# SPDX-License-Identifier: Apache-2.0
"""``stepforge.zero.comm.grad_reducer``'s tensor collectives under torch's current names,
the parameter gather of a layout and the small all-reduce, on one process and on 3 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import counting
from stepforge.zero.comm.grad_reducer import (
    GradReducer,
    all_gather,
    all_gather_name,
    reduce_scatter,
    reduce_scatter_name,
)
from stepforge.zero.comm.param_gather import launch_gather
from stepforge.zero.state.partition import build_layout


def all_reduce_small(value, op, layout, device):
    """The reducer's small all-reduce (the norm's and the overflow flag's) over ``layout``'s group."""
    reducer = GradReducer(
        layout.slots, stage=2, bucket_size=1, overlap=False, group=layout.group, world_size=layout.world_size,
        rank=layout.rank,
    )  # fmt: skip
    reducer.comm_device = device
    return reducer.all_reduce(value, op)


def test_collective_names_exist_in_this_torch():
    assert callable(getattr(dist, all_gather_name))
    assert callable(getattr(dist, reduce_scatter_name))


def _layout(world: int, rank: int, dtype: torch.dtype = torch.bfloat16):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5).to(dtype)), torch.nn.Parameter(torch.randn(2, 2).to(dtype))]
    return params, build_layout(
        [{"params": params}], world, rank, group=None, master_weights=True, master_device=None
    )


def test_one_rank_gather_copies_masters_into_the_params_without_collectives():
    params, layout = _layout(1, 0)
    for slot in layout.slots:
        slot.master.fill_(float(slot.index + 2))
    with counting() as calls:
        launch_gather(layout, "all_gather").wait_all()
    assert sum(v for k, v in calls.items() if not k.endswith(".elements")) == 0
    assert torch.equal(params[0].detach(), torch.full((5,), 2.0, dtype=torch.bfloat16))
    assert torch.equal(params[1].detach(), torch.full((2, 2), 3.0, dtype=torch.bfloat16))
    value = torch.tensor([1.5])
    assert torch.equal(all_reduce_small(value, dist.ReduceOp.SUM, layout, torch.device("cpu")), value)


def _collectives(rank: int, world: int) -> dict:
    out: dict = {}
    local = torch.arange(3.0) + 10 * rank
    gathered = torch.empty(world * 3)
    all_gather(gathered, local, group=None)
    out["all_gather"] = gathered
    flat = torch.arange(world * 2.0) * (rank + 1)  # rank r contributes (r + 1) * [0, 1, ...]
    mine = torch.empty(2)
    reduce_scatter(mine, flat, group=None)
    out["reduce_scatter"] = mine
    # parameter gather: each rank writes rank-dependent masters; both methods give the same full params
    for method in ("all_gather", "broadcast"):
        params, layout = _layout(world, rank)
        for slot in layout.slots:
            slot.master.copy_(torch.arange(slot.start, slot.start + slot.valid, dtype=torch.float32))
        with counting() as calls:
            launch_gather(layout, method).wait_all()
        out["params/" + method] = ([p.detach().float().clone() for p in params], dict(calls))
    out["max"] = all_reduce_small(torch.tensor([float(rank)]), dist.ReduceOp.MAX, layout, torch.device("cpu"))
    out["sum"] = all_reduce_small(torch.tensor([1.0, 2.0]), dist.ReduceOp.SUM, layout, torch.device("cpu"))
    return out


@pytest.mark.distributed
@requires_gloo
def test_collectives_on_three_ranks():
    world = 3
    results = run_distributed(_collectives, world, timeout=120)
    want_gather = torch.cat([torch.arange(3.0) + 10 * r for r in range(world)])
    total = torch.arange(world * 2.0) * sum(r + 1 for r in range(world))
    for rank, out in enumerate(results):
        assert torch.equal(out["all_gather"], want_gather)
        assert torch.equal(out["reduce_scatter"], total[2 * rank : 2 * rank + 2])
        for method, per_call in (("all_gather", "all_gather_into_tensor"), ("broadcast", "broadcast")):
            params, calls = out["params/" + method]
            # every rank wrote its range [start, start + valid) of arange: the gathered params are arange
            assert torch.equal(params[0], torch.arange(5.0))
            assert torch.equal(params[1], torch.arange(4.0).view(2, 2))
            # one partition (one group, one dtype): one all-gather, or one broadcast per rank
            assert calls[per_call] == (1 if method == "all_gather" else world), (method, calls)
        assert out["max"].tolist() == [2.0]
        assert out["sum"].tolist() == [3.0, 6.0]
