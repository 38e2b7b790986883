# SPDX-License-Identifier: Apache-2.0
"""``stepforge.testing.zero_cases``: the shared ZeRO test cases split batches exactly, the references train, and
``counting`` counts what runs inside it (and restores torch.distributed afterwards)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import (
    GLOBAL_BATCH,
    batch,
    counting,
    flat_params,
    local_rows,
    make_model,
    micro_batches,
    rank_rows,
    reference_run,
)


def test_rank_rows_partition_the_batch_and_refuse_an_uneven_split():
    rows = [rank_rows(r, 4, 8) for r in range(4)]
    assert [(s.start, s.stop) for s in rows] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="12 rows does not split over 5 ranks"):
        rank_rows(0, 5, 12)
    assert local_rows(1, 2) == slice(GLOBAL_BATCH // 2, GLOBAL_BATCH)


def test_micro_batches_are_the_rank_shares_of_the_global_batch():
    x, y = batch(3, 1)
    parts = [list(micro_batches(3, 2, r, 2, torch.float32))[1] for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(
        torch.cat([p[1] for p in parts]), y
    )
    assert not torch.equal(batch(3, 0)[0], x)  # micro-batches differ


def test_reference_run_trains_and_low_precision_keeps_masters():
    start = flat_params(make_model())
    model, opt = reference_run("AdamW", steps=2)
    assert not torch.equal(flat_params(model), start)
    assert all(float(s["step"]) == 2 for s in opt.state.values())
    bf16, bf16_opt = reference_run("AdamW", steps=2, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for g in bf16_opt.param_groups for p in g["params"])


def _count(rank: int, world: int) -> dict:
    with counting() as calls:
        dist.all_reduce(torch.ones(3))
        dist.broadcast(torch.ones(5), src=0)
        dist.broadcast(torch.ones(5), src=0)
    return {"calls": dict(calls), "restored": dist.all_reduce.__name__ == "all_reduce"}


@pytest.mark.distributed
@requires_gloo
def test_counting_counts_calls_and_elements_then_restores():
    (out,) = run_distributed(_count, 1, timeout=60)
    assert out["calls"] == {
        "all_reduce": 1,
        "all_reduce.elements": 3,
        "broadcast": 2,
        "broadcast.elements": 10,
    }
    assert out["restored"]
