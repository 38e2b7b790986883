# SPDX-License-Identifier: Apache-2.0
"""``stepforge.accum.OptimWrapper`` drives a LowLevelZeroOptimizer unchanged (core's no_sync + scale_grads_).

Reference: the single-process run with 2 micro-batches per step (fp32, rtol 1e-6). The weighted window
(``num_items``) goes through ``scale_grads_``; with equal item counts it equals the plain window mean. Under
the wrapper's ``optim_context`` the first micro-batch of a window runs inside ``no_sync``, so each window
reduces once per bucket.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.core import build_optimizer
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import (
    flat_params,
    loss_fn,
    make_model,
    micro_batches,
    optimizer_cfg,
    param_groups,
    reference_run,
)
from stepforge.zero.low_level import LowLevelZeroOptimizer

pytestmark = [pytest.mark.distributed, requires_gloo]

STEPS, ACCUM, BUCKET = 3, 2, 1 << 20  # one bucket holds the whole model: one reduction per window


def _wrapped(rank: int, world: int) -> dict:
    from stepforge.accum import OptimWrapper

    out = {}
    for stage in (1, 2):
        for weighted in (False, True):
            model = make_model()
            opt = LowLevelZeroOptimizer(
                build_optimizer(optimizer_cfg("AdamW"), param_groups(model)),
                stage=stage,
                reduce_bucket_size=BUCKET,
            )
            wrapper = OptimWrapper(opt, accumulative_counts=ACCUM)
            for step in range(STEPS):
                for x, y in micro_batches(step, ACCUM, rank, world, torch.float32):
                    with wrapper.optim_context(model):
                        loss = loss_fn(model, x, y)
                        wrapper.update_params(loss, num_items=len(x) if weighted else None)
            counts = opt.collective_counts
            out[(stage, weighted)] = (flat_params(model), counts.reductions)
    return out


def test_optim_wrapper_accumulates_with_one_reduction_per_window():
    results = run_distributed(_wrapped, 2, timeout=180)
    ref = flat_params(reference_run("AdamW", STEPS, ACCUM)[0])
    for rank in range(2):
        for key, (params, reductions) in results[rank].items():
            torch.testing.assert_close(params, ref, rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
            assert reductions == STEPS, f"{key}: {reductions} gradient reductions for {STEPS} windows"
