# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels called directly through the contract (csrc/README.md), on CUDA tensors: SGD.

References are independent: ``torch.optim`` (fused CUDA AdamW/SGD) and the plain loops of
``stepforge.testing.reference``. Every test needs a device (``gpu`` marker); without one they skip with the
reason, and under ``STEPFORGE_REQUIRE_CUDA=1`` the skip is a failure.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.testing.fused_cuda_cases import (
    CODES,
    SHAPES,
    clone_all,
    ctx,
    make,
    ptrs,
    sizes,
)
from stepforge.testing.reference import reference_sgd_step

pytestmark = pytest.mark.gpu


# ---- SGD --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (False, 0.1), (True, 0.0)])
def test_sgd_matches_torch(cuda_mod, nesterov, dampening):
    p = make(SHAPES, torch.float32)
    ref = [t.clone().requires_grad_() for t in p]
    opt = torch.optim.SGD(
        ref, lr=0.05, momentum=0.9, dampening=dampening, weight_decay=1e-3, nesterov=nesterov, foreach=False
    )
    buf = [torch.zeros_like(t) for t in p]
    for step in range(3):
        g = make(SHAPES, torch.float32)
        for r, gi in zip(ref, g, strict=True):
            r.grad = gi.clone()
        opt.step()
        cuda_mod.sgd(
            ptrs(p),
            ptrs(g),
            ptrs(buf),
            None,
            sizes(p),
            [int(step == 0)] * len(p),
            0,
            0,
            0.05,
            0.9,
            dampening,
            1e-3,
            nesterov,
            False,
            1.0,
            0,
            False,
            ctx(),
        )
    torch.cuda.synchronize()
    for a, b in zip(p, ref, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_sgd_wd_after_momentum_and_mixed_first_run(cuda_mod):
    p = make(SHAPES, torch.float32)
    g = make(SHAPES, torch.float32)
    buf = [torch.randn_like(t) for t in p]
    first = [i % 2 for i in range(len(p))]  # per tensor, not per launch (apex's first_run is per launch)
    rp, rbuf = clone_all(p), clone_all(buf)
    cuda_mod.sgd(
        ptrs(p),
        ptrs(g),
        ptrs(buf),
        None,
        sizes(p),
        first,
        0,
        0,
        0.1,
        0.9,
        0.0,
        0.01,
        False,
        True,
        1.0,
        0,
        False,
        ctx(),
    )
    reference_sgd_step(
        rp,
        g,
        rbuf,
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        nesterov=False,
        weight_decay=0.01,
        wd_after_momentum=True,
        first_run=[bool(f) for f in first],
    )
    torch.cuda.synchronize()
    for a, b in zip(p + buf, rp + rbuf, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pdt", [torch.float16, torch.bfloat16])
def test_sgd_master_weights(cuda_mod, pdt):
    master = make(SHAPES, torch.float32)
    params = [t.to(pdt) for t in master]
    g = make(SHAPES, pdt)
    rmaster = clone_all(master)
    cuda_mod.sgd(
        ptrs(params),
        ptrs(g),
        None,
        ptrs(master),
        sizes(params),
        None,
        CODES[pdt],
        CODES[pdt],
        0.1,
        0.0,
        0.0,
        0.0,
        False,
        False,
        1.0,
        0,
        False,
        ctx(),
    )
    reference_sgd_step(
        rmaster,
        [x.float() for x in g],
        [None] * len(g),
        lr=0.1,
        momentum=0.0,
        dampening=0.0,
        nesterov=False,
        weight_decay=0.0,
    )
    torch.cuda.synchronize()
    for mine, ref, low in zip(master, rmaster, params, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)
        assert torch.equal(low, mine.to(pdt))
