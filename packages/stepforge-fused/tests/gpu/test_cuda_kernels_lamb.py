# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels called directly through the contract (csrc/README.md), on CUDA tensors: LAMB.

References are independent: ``torch.optim`` (fused CUDA AdamW/SGD) and the plain loops of
``stepforge.testing.reference``. Every test needs a device (``gpu`` marker); without one they skip with the
reason, and under ``STEPFORGE_REQUIRE_CUDA=1`` the skip is a failure.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.testing.fused_cuda_cases import (
    SHAPES,
    clone_all,
    ctx,
    make,
    ptrs,
    sizes,
)
from stepforge.testing.reference import reference_lamb_step

pytestmark = pytest.mark.gpu


# ---- LAMB -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "wd,nvlamb,clip", [(0.01, False, None), (0.0, False, None), (0.0, True, None), (0.01, False, (0.5, 2.0))]
)
def test_lamb_matches_reference(cuda_mod, wd, nvlamb, clip):
    p = make(SHAPES, torch.float32)
    g = make(SHAPES, torch.float32, scale=0.1)
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    rp, rm, rv = clone_all(p), clone_all(m), clone_all(v)
    ratios = torch.full((len(p),), -1.0, device="cuda")
    lo, hi = clip if clip else (0.0, float("inf"))
    for step in (1, 2):
        cuda_mod.lamb(
            ptrs(p),
            ptrs(g),
            ptrs(m),
            ptrs(v),
            None,
            sizes(p),
            [step] * len(p),
            0,
            0,
            1e-2,
            0.9,
            0.999,
            1e-6,
            wd,
            True,
            True,
            True,
            nvlamb,
            lo,
            hi,
            1.0,
            0,
            False,
            ctx(),
            ratio_out_ptr=ratios.data_ptr(),
        )
        reference_lamb_step(
            rp,
            g,
            rm,
            rv,
            [step - 1] * len(p),
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=wd,
            max_grad_norm=None,
            use_nvlamb=nvlamb,
            trust_clip=clip,
        )
    torch.cuda.synchronize()
    for a, b in zip(p + m + v, rp + rm + rv, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    if wd == 0.0 and not nvlamb:
        assert torch.all(ratios == 1.0)
    assert ratios[0].item() == 1.0  # the empty tensor: both norms 0


def test_lamb_leaves_grads_untouched_and_uses_divisor(cuda_mod):
    p = make(SHAPES, torch.float32)
    g = make(SHAPES, torch.float32)
    g_before = clone_all(g)
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    rp, rm, rv = clone_all(p), clone_all(m), clone_all(v)
    clip = 3.0  # e.g. ||g|| / max_grad_norm, folded into the divisor by the caller
    cuda_mod.lamb(
        ptrs(p),
        ptrs(g),
        ptrs(m),
        ptrs(v),
        None,
        sizes(p),
        [1] * len(p),
        0,
        0,
        1e-2,
        0.9,
        0.999,
        1e-6,
        0.01,
        True,
        True,
        True,
        False,
        0.0,
        float("inf"),
        clip,
        0,
        False,
        ctx(),
    )
    reference_lamb_step(
        rp,
        g,
        rm,
        rv,
        [0] * len(p),
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-6,
        weight_decay=0.01,
        max_grad_norm=None,
        grad_scale=clip,
    )
    torch.cuda.synchronize()
    for a, b in zip(g, g_before, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(p, rp, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
