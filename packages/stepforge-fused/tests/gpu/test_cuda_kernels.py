# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels called directly through the contract (csrc/README.md), on CUDA tensors.

References are independent: ``torch.optim`` (fused CUDA AdamW/SGD) and the plain loops of
``stepforge.testing.reference``. Every test needs a device (``gpu`` marker); without one they skip with the
reason, and under ``STEPFORGE_REQUIRE_CUDA=1`` the skip is a failure.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.testing.reference import reference_adam_step, reference_lamb_step, reference_sgd_step

pytestmark = pytest.mark.gpu

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Ragged on purpose: empty, tails that are not a multiple of 4, exactly one chunk (16384), one chunk + 1.
SHAPES = [(0,), (1,), (3,), (7, 5), (4096,), (16384,), (16385,), (3, 33333)]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def ptrs(ts):
    return [t.data_ptr() for t in ts]


def sizes(ts):
    return [t.numel() for t in ts]


def ctx():
    return torch.cuda.current_stream().cuda_stream


def make(shapes, dtype, *, scale=1.0, device="cuda"):
    return [(torch.randn(s, device=device) * scale).to(dtype) for s in shapes]


def clone_all(ts):
    return [t.clone() for t in ts]


def adam_call(
    mod,
    p,
    g,
    m,
    v,
    steps,
    *,
    masters=None,
    lr=1e-3,
    wd=0.01,
    adamw=True,
    div=1.0,
    found_inf=None,
    check_finite=False,
    **kw,
):
    pdt = p[0].dtype if p else torch.float32
    gdt = g[0].dtype if g else torch.float32
    return mod.adam(
        ptrs(p),
        ptrs(g),
        ptrs(m),
        ptrs(v),
        None if masters is None else ptrs(masters),
        sizes(p),
        steps,
        CODES[pdt],
        CODES[gdt],
        lr,
        0.9,
        0.999,
        1e-8,
        wd,
        adamw,
        True,
        div,
        0 if found_inf is None else found_inf.data_ptr(),
        check_finite,
        ctx(),
        **kw,
    )


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


# ---- l2norm / scale ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_l2norm_global_and_per_tensor(cuda_mod, dtype):
    xs = make(SHAPES, dtype)
    per = torch.empty(len(xs), device="cuda")
    total = cuda_mod.l2norm(ptrs(xs), sizes(xs), CODES[dtype], per.data_ptr(), ctx())
    expect = [torch.linalg.vector_norm(x.double()).item() for x in xs]
    assert total == pytest.approx(sum(e * e for e in expect) ** 0.5, rel=1e-5)
    torch.testing.assert_close(
        per.double(), torch.tensor(expect, device="cuda", dtype=torch.float64), rtol=1e-5, atol=1e-6
    )


def test_l2norm_accumulates_buckets_on_device(cuda_mod):
    a = make(SHAPES, torch.float32)
    b = make(SHAPES, torch.bfloat16)
    sumsq = torch.zeros(1, device="cuda")
    assert cuda_mod.l2norm(ptrs(a), sizes(a), 0, 0, ctx(), sumsq_out_ptr=sumsq.data_ptr()) is None
    assert cuda_mod.l2norm(ptrs(b), sizes(b), 2, 0, ctx(), sumsq_out_ptr=sumsq.data_ptr()) is None
    expect = sum(float(x.double().pow(2).sum()) for x in a + b)
    assert sumsq.item() == pytest.approx(expect, rel=1e-5)


def test_scale_unscale_with_inf_flag(cuda_mod):
    src = make(SHAPES, torch.float16, scale=100.0)
    dst = [torch.empty(t.shape, device="cuda") for t in src]
    flag = torch.zeros(1, device="cuda")
    cuda_mod.scale(ptrs(src), ptrs(dst), sizes(src), 1, 0, 1 / 64, flag.data_ptr(), ctx())
    assert flag.item() == 0.0
    for s, d in zip(src, dst, strict=True):
        torch.testing.assert_close(d, s.float() / 64, rtol=0, atol=0)
    src[3][0, 0] = float("nan")
    cuda_mod.scale(ptrs(src), ptrs(src), sizes(src), 1, 1, 0.5, flag.data_ptr(), ctx())
    assert flag.item() == 1.0


# ---- CUDA graphs ------------------------------------------------------------------------------------------
def test_adam_graph_capture_with_device_lr_and_steps(cuda_mod):
    from stepforge.testing.fused_cuda import device_step_ptrs, increment_device_steps

    shapes = [(1000,), (17, 33), (16385,)]
    p = make(shapes, torch.float32)
    ref = [t.clone().requires_grad_() for t in p]
    opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    g = [torch.zeros(s, device="cuda") for s in shapes]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    steps = [torch.zeros((), device="cuda") for _ in p]
    lr = torch.tensor([1e-3], device="cuda")
    found_inf = torch.zeros(1, device="cuda")

    def step():
        increment_device_steps(steps, found_inf)
        cuda_mod.adam(
            ptrs(p),
            ptrs(g),
            ptrs(m),
            ptrs(v),
            None,
            sizes(p),
            None,
            0,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            True,
            True,
            1.0,
            found_inf.data_ptr(),
            False,
            ctx(),
            lr_ptr=lr.data_ptr(),
            step_ptrs=device_step_ptrs(steps),
            device=torch.cuda.current_device(),  # no pointer-attribute query inside the capture
        )

    # Launch tables are cached per stream: warm up on the stream the graph is captured on.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        snapshot = [clone_all(x) for x in (p, m, v)] + [clone_all(steps)]
        step()  # warm-up: uploads the launch table outside the capture
        for dst, src in zip((p, m, v, steps), snapshot, strict=True):
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    for _ in range(3):
        new = make(shapes, torch.float32)
        for gi, r, n in zip(g, ref, new, strict=True):
            gi.copy_(n)
            r.grad = n.clone()
        opt.step()
        graph.replay()
    torch.cuda.synchronize()
    assert [s.item() for s in steps] == [3.0, 3.0, 3.0]
    for a, b in zip(p, ref, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


# ---- 64-bit indexing --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensor_above_2_pow_31_elements(cuda_mod):
    from stepforge.testing.gpu import optional_skip

    n = (1 << 31) + 4099
    need = n * 4 * 2 + (1 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        optional_skip(f"needs {need / 2**30:.1f} GiB free device memory, {free / 2**30:.1f} GiB available")
    p = torch.zeros(n, device="cuda")
    g = torch.ones(n, device="cuda")
    cuda_mod.sgd(
        [p.data_ptr()],
        [g.data_ptr()],
        None,
        None,
        [n],
        None,
        0,
        0,
        1.0,
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
    torch.cuda.synchronize()
    # Every element moved, including those past 2**31 (a 32-bit index would wrap or stop there).
    assert (
        p[-4099:].eq(-1.0).all()
        and p[:4099].eq(-1.0).all()
        and p[(1 << 31) - 2 : (1 << 31) + 2].eq(-1.0).all()
    )
    assert p.sum(dtype=torch.float64).item() == -n
    norm = cuda_mod.l2norm([g.data_ptr()], [n], 0, 0, ctx())
    assert norm == pytest.approx(n**0.5, rel=1e-6)


# ---- CPU vs GPU -------------------------------------------------------------------------------------------
def test_cpu_and_cuda_modules_agree(cuda_mod):
    cpu_mod = pytest.importorskip("stepforge.fused._cpu", reason="the _cpu module is not built")
    p = make(SHAPES, torch.float32, device="cpu")
    g = make(SHAPES, torch.float32, device="cpu")
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    cp, cg, cm, cv = ([t.cuda() for t in x] for x in (p, g, m, v))
    for step in (1, 2):
        cpu_mod.adam(
            ptrs(p),
            ptrs(g),
            ptrs(m),
            ptrs(v),
            None,
            sizes(p),
            [step] * len(p),
            0,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            True,
            True,
            1.0,
            0,
            False,
            0,
        )
        adam_call(cuda_mod, cp, cg, cm, cv, [step] * len(p))
    torch.cuda.synchronize()
    for a, b in zip(p + m + v, cp + cm + cv, strict=True):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-6, atol=1e-7)
