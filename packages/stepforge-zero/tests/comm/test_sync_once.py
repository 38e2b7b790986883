# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer.sync_grads``: gradients are synchronised once per step, whichever of
``scale_grads_``, ``unscale_``, ``clip_grad_norm_`` and ``step`` come first, with fp16 loss scaling and clipping
on; a backward after the sync re-opens it. Collectives counted by wrapping ``torch.distributed``.

Model: 6 fp16 parameters of 40 elements at 2 ranks, ``reduce_bucket_size=80``: 3 buckets per synchronised
backward. Every step also makes one overflow all-reduce and one norm all-reduce per clipping.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import counting
from stepforge.zero.low_level import LowLevelZeroOptimizer

pytestmark = [pytest.mark.distributed, requires_gloo]

NPARAMS, NUMEL, BUCKET = 6, 40, 80
BUCKETS = 3
LR = 0.125


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(
            [nn.Parameter(torch.ones(NUMEL, dtype=torch.float16)) for _ in range(NPARAMS)]
        )

    def forward(self, scale: float) -> torch.Tensor:
        return sum((p * scale).sum() for p in self.ps)


def _build(stage: int) -> tuple[_Flat, LowLevelZeroOptimizer]:
    model = _Flat()
    opt = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        stage=stage,
        reduce_bucket_size=BUCKET,
        max_norm=1e6,  # clipping on inside step (never binding here)
        param_gather="all_gather",
        initial_scale=2**4,
        comm_algorithm="reduce_scatter" if stage == 2 else "all_reduce",  # counted below per stage
    )
    assert opt.loss_scale == 2**4  # fp16 parameters: loss scaling is on
    return model, opt


def _every_door(rank: int, world: int) -> dict:
    out: dict = {}
    for stage in (1, 2):
        model, opt = _build(stage)
        for step in range(2):
            before = opt.collective_counts.syncs
            with counting() as calls:
                opt.backward(model(float(rank + 1)))
                opt.scale_grads_(0.5)
                opt.unscale_()
                opt.clip_grad_norm_(1e6)
                assert opt.sync_grads() is False  # already final for this step
                opt.step()
                opt.zero_grad()
            out[(stage, step)] = (opt.collective_counts.syncs - before, dict(calls))
        # grad of each element: mean over ranks of (r + 1) = 1.5, times 0.5 -> 0.75; two steps of lr 1/8
        out[(stage, "params")] = torch.cat([p.detach().float() for p in model.ps])
        # a backward after the sync re-opens it: both backwards reach the step
        model, opt = _build(stage)
        opt.backward(model(float(rank + 1)))
        assert opt.sync_grads() is True
        opt.backward(model(float(rank + 1)))
        opt.step()
        out[(stage, "reopened")] = (
            opt.collective_counts.syncs,
            torch.cat([p.detach().float() for p in model.ps]),
        )
        # ... but not after the pieces were unscaled: scaled and unscaled gradients would be summed
        model, opt = _build(stage)
        opt.backward(model(float(rank + 1)))
        opt.clip_grad_norm_(1e6)
        opt.backward(model(float(rank + 1)))
        with pytest.raises(RuntimeError, match="a backward ran after unscale_\\(\\) / clip_grad_norm_\\(\\)"):
            opt.step()
        opt.zero_grad()  # starts the step again
        opt.backward(model(float(rank + 1)))
        opt.step()
        out[(stage, "restarted")] = torch.cat([p.detach().float() for p in model.ps])
    return out


def _accum_window(rank: int, world: int) -> dict:
    from stepforge.accum import OptimWrapper

    out: dict = {}
    for stage in (1, 2):
        model, opt = _build(stage)
        wrapper = OptimWrapper(opt, accumulative_counts=2, clip_grad=dict(max_norm=1e6))
        for window in range(2):
            before = opt.collective_counts.syncs
            reductions = opt.collective_counts.reductions
            for _ in range(2):
                with wrapper.optim_context(model):  # no_sync for the window's first micro-batch
                    wrapper.update_params(model(float(rank + 1)), num_items=4)  # weighted: scale_grads_
            counts = opt.collective_counts
            out[(stage, window)] = (
                counts.syncs - before,
                counts.reductions - reductions,
            )
    return out


@pytest.fixture(scope="module")
def doors() -> list[dict]:
    return run_distributed(_every_door, 2, timeout=120)


@pytest.mark.parametrize("stage", [1, 2])
def test_one_sync_per_step_through_every_door(doors, stage):
    for rank in range(2):
        for step in range(2):
            syncs, calls = doors[rank][(stage, step)]
            assert syncs == 1, (rank, step, syncs)
            grad_op = "reduce_scatter_tensor" if stage == 2 else "all_reduce"
            assert calls[grad_op] - (3 if stage == 1 else 0) == BUCKETS, calls
            # small all-reduces: 1 overflow check + 2 norms (clip_grad_norm_ and max_norm inside step)
            assert calls["all_reduce"] - (BUCKETS if stage == 1 else 0) == 3, calls
            assert calls["all_gather_into_tensor"] == 1, calls  # one partition
        want = torch.full((NPARAMS * NUMEL,), 1.0 - 2 * LR * 0.75)
        assert torch.equal(doors[rank][(stage, "params")], want)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_backward_after_the_sync_reopens_it(doors, stage):
    for rank in range(2):
        syncs, params = doors[rank][(stage, "reopened")]
        assert syncs == 2
        assert torch.equal(params, torch.full((NPARAMS * NUMEL,), 1.0 - LR * 2 * 1.5))  # both backwards
        restarted = doors[rank][(stage, "restarted")]
        assert torch.equal(restarted, torch.full((NPARAMS * NUMEL,), 1.0 - LR * 1.5))  # one backward


def test_accumulation_wrapper_syncs_once_per_window():
    results = run_distributed(_accum_window, 2, timeout=120)
    for rank in range(2):
        for stage in (1, 2):
            for window in range(2):
                syncs, reductions = results[rank][(stage, window)]
                assert syncs == 1, (rank, stage, window)
                assert reductions == BUCKETS, (rank, stage, window, reductions)  # the window, reduced once
