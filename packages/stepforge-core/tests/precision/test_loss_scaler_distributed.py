# SPDX-License-Identifier: Apache-2.0
"""DynamicLossScaler on 2 gloo processes: one rank's overflow is every rank's, only through the process group."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from stepforge.core.precision import DynamicLossScaler
from stepforge.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _agreement(rank: int, world_size: int) -> dict:
    out: dict = {}
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    shared = DynamicLossScaler(initial_scale=4.0, hysteresis=1, process_group=dist.group.WORLD)
    alone = DynamicLossScaler(initial_scale=4.0, hysteresis=1)
    for name, scaler in (("shared", shared), ("alone", alone)):
        verdicts, scales = [], []
        # step 0: only rank 1 overflows; step 1: nobody; step 2: only rank 0 overflows
        for step, bad_rank in enumerate((1, None, 0)):
            p.grad = torch.full((3,), 8.0)
            if rank == bad_rank:
                p.grad[2] = math.inf
            verdicts.append(scaler.unscale_(opt))
            out[(name, step, "grad0")] = p.grad[0].item()
            scaler.update()
            scales.append(scaler.get_scale())
        out[(name, "verdicts")] = verdicts
        out[(name, "scales")] = scales
    # the explicit-gradient path and agree() alone, as ZeRO uses them
    out["agree"] = shared.agree(rank == 0)
    out["grads"] = shared.unscale_grads_([torch.tensor([1.0, -math.inf if rank == 1 else 2.0])])
    return out


def test_one_rank_overflowing_makes_every_rank_skip():
    results = run_distributed(_agreement, 2, timeout=90)
    for rank, out in enumerate(results):
        assert out[("shared", "verdicts")] == [True, False, True], rank
        assert out[("shared", "scales")] == [2.0, 2.0, 1.0], rank
        assert out[("alone", "verdicts")] == [rank == 1, False, rank == 0], rank
        expected_alone = [2.0, 2.0, 2.0] if rank == 1 else [4.0, 4.0, 2.0]
        assert out[("alone", "scales")] == expected_alone, rank
        # the gradients are unscaled by the scale in force at the time
        assert [out[("shared", s, "grad0")] for s in range(3)] == [2.0, 4.0, 4.0], rank
        assert out["agree"] is True and out["grads"] is True, rank
