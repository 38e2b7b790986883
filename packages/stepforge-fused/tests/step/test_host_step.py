# SPDX-License-Identifier: Apache-2.0
"""``_step.eager.run_host``: the CPU step over several buckets (pre-check, launches, skips, GradScaler unscale)."""

from __future__ import annotations

import torch

from stepforge.fused import FusedAdam
from stepforge.fused._step.device import SkipTracker
from stepforge.fused._step.eager import UnscalePlan, all_finite, run_host
from stepforge.testing.tensors import bits_equal, clone_params


def _two_buckets(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [
        torch.nn.Parameter(torch.randn(7, generator=gen)),
        torch.nn.Parameter(torch.randn(5, generator=gen).bfloat16()),
    ]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    return ps


def _plans(opt):
    cache = opt._bucket_cache
    plans = [(g, cache.group_buckets(opt, i, g)) for i, g in enumerate(opt.param_groups)]
    return plans, [(g, b) for g, bs in plans for b in bs]


def test_a_non_finite_grad_in_any_bucket_skips_all_of_them():
    ps = _two_buckets()
    ps[1].grad[2] = float("nan")
    opt = FusedAdam(ps, lr=1e-2)
    before = [p.detach().clone() for p in ps]
    plans, buckets = _plans(opt)
    assert len(buckets) == 2
    assert not all_finite(opt, buckets, 1.0, sharded=False)
    skips = SkipTracker()
    run_host(opt, plans, buckets, UnscalePlan(1.0), True, skips)
    assert skips.host_count == 1 and bits_equal(ps, before)


def test_run_steps_every_bucket_like_the_optimizer_and_unscales_the_grads():
    ps = _two_buckets(3)
    twins = clone_params(ps)
    for p, q in zip(ps, twins, strict=True):
        q.grad = p.grad.clone()
    opt, ref = FusedAdam(ps, lr=1e-2), FusedAdam(twins, lr=1e-2)
    plans, buckets = _plans(opt)
    # the kernels divide by 8 (div_scale 2 x scale 4): the grads are left divided by the scale in a second pass
    run_host(opt, plans, buckets, UnscalePlan(8.0, unscale_by=4.0), False, SkipTracker())
    ref.step(div_scale=8.0)
    assert bits_equal(ps, twins)
    for p, q in zip(ps, twins, strict=True):
        assert torch.equal(p.grad, q.grad / 4.0)
    assert all(float(opt.state[p]["step"]) == 1.0 for p in ps)
