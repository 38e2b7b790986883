# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels called directly through the contract (csrc/README.md), on CUDA tensors: Adam (SGD, LAMB, l2norm/scale/graphs/64-bit/CPU-vs-GPU in the test_cuda_kernels_*.py beside it).

References are independent: ``torch.optim`` (fused CUDA AdamW/SGD) and the plain loops of
``stepforge.testing.reference``. Every test needs a device (``gpu`` marker); without one they skip with the
reason, and under ``STEPFORGE_REQUIRE_CUDA=1`` the skip is a failure.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.testing.fused_cuda_cases import (
    SHAPES,
    TOL,
    adam_call,
    clone_all,
    ctx,
    make,
    ptrs,
    sizes,
)
from stepforge.testing.reference import reference_adam_step

pytestmark = pytest.mark.gpu


# ---- Adam -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_fp32_matches_torch_fused(cuda_mod, adamw):
    p = make(SHAPES, torch.float32)
    ref = [t.clone().requires_grad_() for t in p]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(ref, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    for step in range(1, 4):
        g = make(SHAPES, torch.float32)
        for r, gi in zip(ref, g, strict=True):
            r.grad = gi.clone()
        opt.step()
        assert adam_call(cuda_mod, p, g, m, v, [step] * len(p), adamw=adamw) is None
    torch.cuda.synchronize()
    for mine, theirs in zip(p, ref, strict=True):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-7)
    for mine, r in zip(m, ref, strict=True):
        torch.testing.assert_close(mine, opt.state[r]["exp_avg"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pdt", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gdt", ["same", torch.float32])
def test_adam_low_precision_params(cuda_mod, pdt, gdt):
    gdt = pdt if gdt == "same" else gdt
    p = make(SHAPES, pdt)
    g = make(SHAPES, gdt)
    m = [torch.zeros(t.shape, device="cuda") for t in p]
    v = [torch.zeros(t.shape, device="cuda") for t in p]
    rp, rm, rv = clone_all(p), clone_all(m), clone_all(v)
    adam_call(cuda_mod, p, g, m, v, [1] * len(p))
    reference_adam_step(
        rp,
        g,
        rm,
        rv,
        [0] * len(p),
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        adamw_mode=True,
        bias_correction=True,
    )
    torch.cuda.synchronize()
    for a, b in zip(p, rp, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **TOL[pdt])
    for a, b in zip(m, rm, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pdt", [torch.float16, torch.bfloat16])
def test_adam_master_weights(cuda_mod, pdt):
    master = make(SHAPES, torch.float32)
    params = [t.to(pdt) for t in master]
    g = make(SHAPES, pdt)
    m = [torch.zeros_like(t) for t in master]
    v = [torch.zeros_like(t) for t in master]
    rmaster, rm, rv = clone_all(master), clone_all(m), clone_all(v)
    adam_call(cuda_mod, params, g, m, v, [1] * len(params), masters=master)
    reference_adam_step(
        rmaster,
        [x.float() for x in g],
        rm,
        rv,
        [0] * len(master),
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        adamw_mode=True,
        bias_correction=True,
    )
    torch.cuda.synchronize()
    for mine, ref, low in zip(master, rmaster, params, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
        # The low-precision copy is the master rounded to nearest even, in the same pass.
        assert torch.equal(low, mine.to(pdt))


def test_adam_per_tensor_steps(cuda_mod):
    p = make([(100,), (50,), (70,)], torch.float32)
    g = make([(100,), (50,), (70,)], torch.float32)
    m = [torch.randn_like(t).abs() for t in p]
    v = [torch.rand_like(t) for t in p]
    rp, rm, rv = clone_all(p), clone_all(m), clone_all(v)
    adam_call(cuda_mod, p, g, m, v, [1, 7, 300])
    reference_adam_step(
        rp,
        g,
        rm,
        rv,
        [0, 6, 299],
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        adamw_mode=True,
        bias_correction=True,
    )
    torch.cuda.synchronize()
    for a, b in zip(p, rp, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_adam_grad_divisor(cuda_mod):
    p = make(SHAPES, torch.float32)
    g = make(SHAPES, torch.float32)
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    p2, m2, v2 = clone_all(p), clone_all(m), clone_all(v)
    adam_call(cuda_mod, p, g, m, v, [1] * len(p))
    adam_call(cuda_mod, p2, [x * 1024 for x in g], m2, v2, [1] * len(p), div=1024.0)
    torch.cuda.synchronize()
    for a, b in zip(p, p2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_overflow_skips_every_kernel(cuda_mod):
    p = make(SHAPES, torch.float32)
    g = make(SHAPES, torch.float32)
    g[-1][0, 5] = float("inf")
    m = [torch.ones_like(t) for t in p]
    v = [torch.ones_like(t) for t in p]
    before = clone_all(p) + clone_all(m) + clone_all(v)
    found_inf = torch.zeros(1, device="cuda")
    adam_call(cuda_mod, p, g, m, v, [1] * len(p), found_inf=found_inf, check_finite=True)
    assert found_inf.item() == 1.0
    for a, b in zip(p + m + v, before, strict=True):
        assert torch.equal(a, b)
    # found_inf already set on entry: SGD and LAMB skip too, even without their own check.
    g[-1][0, 5] = 0.0
    buf = [torch.zeros_like(t) for t in p]
    cuda_mod.sgd(
        ptrs(p),
        ptrs(g),
        ptrs(buf),
        None,
        sizes(p),
        [1] * len(p),
        0,
        0,
        0.1,
        0.9,
        0.0,
        0.0,
        False,
        False,
        1.0,
        found_inf.data_ptr(),
        False,
        ctx(),
    )
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
        1e-3,
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
        1.0,
        found_inf.data_ptr(),
        False,
        ctx(),
    )
    torch.cuda.synchronize()
    for a, b in zip(p + m + v, before, strict=True):
        assert torch.equal(a, b)
    # check_finite without a found_inf buffer: the launcher answers (like the CPU module), reading its flag back.
    g[-1][0, 5] = float("nan")
    assert adam_call(cuda_mod, p, g, m, v, [1] * len(p), check_finite=True) is True
    for a, b in zip(p + m + v, before, strict=True):
        assert torch.equal(a, b)
    g[-1][0, 5] = 0.0
    # With a clear flag, the update goes ahead.
    found_inf.zero_()
    assert adam_call(cuda_mod, p, g, m, v, [1] * len(p), found_inf=found_inf, check_finite=True) is None
    assert found_inf.item() == 0.0
    assert not torch.equal(p[-1], before[len(p) - 1])
    assert adam_call(cuda_mod, p, g, m, v, [2] * len(p), check_finite=True) is False


def test_misaligned_views_and_many_small_tensors(cuda_mod):
    base = torch.randn(200_003, device="cuda")
    # Views at odd offsets defeat the vector path; the scalar path must give the same numbers.
    p = [
        base[1:1001],
        base[1003:5000],
        base[5001:5002],
        *make([(s,) for s in range(1, 3000, 7)], torch.float32),
    ]
    g = make([t.shape for t in p], torch.float32)
    m = [torch.zeros(t.shape, device="cuda") for t in p]
    v = [torch.zeros(t.shape, device="cuda") for t in p]
    rp, rm, rv = [t.clone() for t in p], clone_all(m), clone_all(v)
    adam_call(cuda_mod, p, g, m, v, [1] * len(p))
    reference_adam_step(
        rp,
        g,
        rm,
        rv,
        [0] * len(p),
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        adamw_mode=True,
        bias_correction=True,
    )
    torch.cuda.synchronize()
    for a, b in zip(p, rp, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_unchanged_lists_are_not_uploaded_again(cuda_mod):
    p = make(SHAPES, torch.float32)
    g = make(SHAPES, torch.float32)
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    adam_call(cuda_mod, p, g, m, v, [1] * len(p))
    uploads = cuda_mod.table_uploads()
    for step in range(2, 6):
        adam_call(cuda_mod, p, g, m, v, [step] * len(p))
    assert cuda_mod.table_uploads() == uploads


def test_stochastic_rounding_is_unbiased(cuda_mod):
    n = 1 << 20
    p_rne = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    p_sr = p_rne.clone()
    g = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    lr = 1e-4  # far below bf16's spacing at 1.0 (2**-8 below 1): round-to-nearest never moves
    for p, sr in ((p_rne, False), (p_sr, True)):
        cuda_mod.sgd(
            [p.data_ptr()],
            [g.data_ptr()],
            None,
            None,
            [n],
            None,
            2,
            2,
            lr,
            0.0,
            0.0,
            0.0,
            False,
            False,
            1.0,
            0,
            False,
            ctx(),
            stochastic_rounding=sr,
            seed=1234,
        )
    torch.cuda.synchronize()
    assert torch.all(p_rne == 1.0)
    mean = p_sr.double().mean().item()
    assert abs(mean - (1.0 - lr)) < 2e-5, mean
    assert set(p_sr.unique().tolist()) == {1.0, 1.0 - 2**-8}
