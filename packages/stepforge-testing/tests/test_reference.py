# SPDX-License-Identifier: Apache-2.0
"""The reference optimizers against torch.optim (Adam, AdamW, SGD) and against independent NumPy fp64 code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stepforge.testing.reference import (
    ReferenceAdam,
    ReferenceLamb,
    ReferenceLars,
    ReferenceSGD,
    reference_adam_step,
    reference_global_grad_norm,
    reference_lamb_step,
    reference_lars_step,
    reference_sgd_step,
)

SHAPES = [(3, 5), (7,), (2, 3, 4), (1,)]


def _params(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in SHAPES]


def _run(opt_cls, kwargs, steps=6, dtype=torch.float64, seed=0):
    params = _params(dtype, seed)
    opt = opt_cls(params, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
    return [p.detach() for p in params]


def _close(a, b, rtol=1e-10, atol=1e-12):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("maximize", [False, True])
def test_reference_adam_matches_torch_adam_and_adamw(wd, maximize):
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=wd, maximize=maximize)
    _close(_run(ReferenceAdam, {**kw, "adamw_mode": False}), _run(torch.optim.Adam, kw))
    _close(_run(ReferenceAdam, {**kw, "adamw_mode": True}), _run(torch.optim.AdamW, kw))


@pytest.mark.parametrize(
    "kw",
    [
        dict(momentum=0.0),
        dict(momentum=0.9),
        dict(momentum=0.9, dampening=0.3, weight_decay=0.05),
        dict(momentum=0.9, nesterov=True, weight_decay=0.05),
        dict(momentum=0.5, weight_decay=0.1, maximize=True),
    ],
)
def test_reference_sgd_matches_torch_sgd(kw):
    _close(_run(ReferenceSGD, {"lr": 0.05, **kw}), _run(torch.optim.SGD, {"lr": 0.05, **kw}))


def test_reference_sgd_wd_after_momentum_numpy():
    p0, lr, mu, wd, damp = np.array([1.0, -2.0, 0.5]), 0.1, 0.9, 0.01, 0.2
    gs = [np.array([0.3, 0.1, -0.2]), np.array([-0.5, 0.4, 0.0]), np.array([0.2, 0.2, 0.2])]
    p, buf = p0.copy(), None
    for g in gs:
        buf = g.copy() if buf is None else mu * buf + (1 - damp) * g
        p = p - lr * (buf + wd * p)
    pt, bufs = torch.tensor(p0), [None]
    for g in gs:
        reference_sgd_step(
            [pt],
            [torch.tensor(g)],
            bufs,
            lr=lr,
            momentum=mu,
            dampening=damp,
            nesterov=False,
            weight_decay=wd,
            wd_after_momentum=True,
        )
    np.testing.assert_allclose(pt.numpy(), p, rtol=1e-12)
    np.testing.assert_allclose(bufs[0].numpy(), buf, rtol=1e-12)


def test_reference_sgd_first_run_per_tensor_resets_buffer():
    p, buf = torch.zeros(3, dtype=torch.float64), torch.full((3,), 5.0, dtype=torch.float64)
    bufs = [buf]
    g = torch.ones(3, dtype=torch.float64)
    reference_sgd_step(
        [p],
        [g],
        bufs,
        lr=1.0,
        momentum=0.9,
        dampening=0.0,
        nesterov=False,
        weight_decay=0.0,
        first_run=[True],
    )
    torch.testing.assert_close(buf, g)  # the old content was ignored and overwritten in place
    torch.testing.assert_close(p, -g)


def _np_lamb(
    ps,
    gss,
    *,
    lr,
    b1,
    b2,
    eps,
    wd,
    adam_w=True,
    avg=True,
    bc=True,
    mode="update",
    clip=1.0,
    nvlamb=False,
    trust=None,
    scale=1.0,
):
    ps = [p.copy() for p in ps]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    for t, gs in enumerate(gss, start=1):
        gs = [g / scale for g in gs]
        norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
        c = norm / clip if clip and norm > clip else 1.0
        for i, p in enumerate(ps):
            g = gs[i] / c
            if not adam_w:
                g = g + wd * p
            ms[i] = b1 * ms[i] + ((1 - b1) if avg else 1.0) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if bc else (1.0, 1.0)
            if mode == "update":
                u, s = (ms[i] / bc1) / (np.sqrt(vs[i] / bc2) + eps), 1.0
            else:
                u, s = ms[i] / (np.sqrt(vs[i]) + eps), math.sqrt(bc2) / bc1
            if adam_w:
                u = u + wd * p
            r = 1.0
            if wd != 0 or nvlamb:
                wn, un = np.linalg.norm(p), np.linalg.norm(u)
                if wn > 0 and un > 0:
                    r = wn / un
                    if trust is not None:
                        r = min(max(r, trust[0]), trust[1])
            ps[i] = p - lr * s * r * u
    return ps


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(wd=0.0),
        dict(wd=0.0, nvlamb=True),
        dict(adam_w=False, avg=False),
        dict(bc=False, clip=None, nvlamb=True),
        dict(mode="step_size", clip=0.5, trust=(0.1, 2.0)),
        dict(clip=1e6, scale=128.0),
    ],
)
def test_reference_lamb_matches_numpy(opts):
    rng = np.random.default_rng(3)
    ps = [rng.standard_normal(s) for s in SHAPES]
    gss = [[rng.standard_normal(s) * 3 for s in SHAPES] for _ in range(5)]
    base = dict(lr=0.02, b1=0.9, b2=0.99, eps=1e-6, wd=0.05)
    expected = _np_lamb(ps, gss, **{**base, **opts})
    tps = [torch.tensor(p) for p in ps]
    ms = [torch.zeros_like(p) for p in tps]
    vs = [torch.zeros_like(p) for p in tps]
    steps = [0] * len(tps)
    o = {**base, **opts}
    for gs in gss:
        grads = [torch.tensor(g) for g in gs]
        before = [g.clone() for g in grads]
        reference_lamb_step(
            tps,
            grads,
            ms,
            vs,
            steps,
            lr=o["lr"],
            beta1=o["b1"],
            beta2=o["b2"],
            eps=o["eps"],
            weight_decay=o["wd"],
            adam_w_mode=o.get("adam_w", True),
            grad_averaging=o.get("avg", True),
            bias_correction=o.get("bc", True),
            bias_correction_mode=o.get("mode", "update"),
            max_grad_norm=o.get("clip", 1.0),
            use_nvlamb=o.get("nvlamb", False),
            trust_clip=o.get("trust"),
            grad_scale=o.get("scale", 1.0),
        )
        _close(grads, before, rtol=0, atol=0)  # gradients are never written
    assert steps == [5] * len(tps)
    for got, want in zip(tps, expected, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_reference_lamb_class_norm_spans_groups():
    a, b = torch.tensor([3.0], dtype=torch.float64), torch.tensor([4.0], dtype=torch.float64)
    pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
    opt = ReferenceLamb([{"params": [pa]}, {"params": [pb]}], lr=0.1, weight_decay=0.0, max_grad_norm=1.0)
    pa.grad, pb.grad = torch.tensor([3.0], dtype=torch.float64), torch.tensor([4.0], dtype=torch.float64)
    opt.step()
    # global norm 5 -> grads (0.6, 0.8); after one bias-corrected step u = g/(|g|+eps), ratio 1 (wd=0)
    torch.testing.assert_close(pa.detach(), a - 0.1 * 0.6 / (0.6 + 1e-6))
    torch.testing.assert_close(pb.detach(), b - 0.1 * 0.8 / (0.8 + 1e-6))
    assert reference_global_grad_norm([pa.grad, pb.grad]) == pytest.approx(5.0)


def _np_lars(p, gs, *, lr, mu, eeta, wd, eps, damp=0.0, nesterov=False, clip=10.0, trust=(0.0, 50.0)):
    p, buf = p.copy(), None
    for g in gs:
        wn, gn = np.linalg.norm(p), np.linalg.norm(g)
        r = eeta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
        if trust is not None:
            r = min(max(r, trust[0]), trust[1])
        d = g + wd * p
        if clip is not None:
            d = np.clip(d, -clip, clip)
        if mu:
            buf = d.copy() if buf is None else mu * buf + (1 - damp) * d
            d = d + mu * buf if nesterov else buf
        p = p - lr * r * d
    return p


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(mu=0.9, wd=1e-2),
        dict(mu=0.9, damp=0.1, nesterov=False, wd=5e-4, eps=1e-8),
        dict(mu=0.9, nesterov=True, clip=None, trust=None, eeta=0.5),
        dict(mu=0.0, clip=0.05, trust=(0.0, 0.5), eeta=1.0),
    ],
)
def test_reference_lars_matches_numpy(opts):
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal((4, 6))
    gs = [rng.standard_normal((4, 6)) * 20 for _ in range(5)]
    o = {**dict(lr=0.1, mu=0.0, eeta=1e-3, wd=0.0, eps=0.0), **opts}
    want = _np_lars(p0, gs, **o)
    p, bufs = torch.tensor(p0), [None]
    for g in gs:
        reference_lars_step(
            [p],
            [torch.tensor(g)],
            bufs,
            lr=o["lr"],
            momentum=o["mu"],
            dampening=o.get("damp", 0.0),
            nesterov=o.get("nesterov", False),
            eeta=o["eeta"],
            weight_decay=o["wd"],
            epsilon=o["eps"],
            grad_clip=o.get("clip", 10.0),
            trust_clip=o.get("trust", (0.0, 50.0)),
        )
    np.testing.assert_allclose(p.numpy(), want, rtol=1e-10, atol=1e-12)


def test_reference_lars_class_group_lars_false_and_exclusion():
    w, bias = torch.ones(4, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    pw, pb = w.clone().requires_grad_(), bias.clone().requires_grad_()
    opt = ReferenceLars(
        [pw, pb], lr=0.5, eeta=0.01, weight_decay=0.1, exclude_from_adaptation=lambda p: p.ndim == 1
    )
    pw.grad, pb.grad = torch.full_like(w, 2.0), torch.full_like(bias, 2.0)
    opt.step()
    r = 0.01 * 4.0 / (8.0 + 0.1 * 4.0)
    torch.testing.assert_close(pw.detach(), w - 0.5 * r * (2.0 + 0.1 * w))
    torch.testing.assert_close(pb.detach(), bias - 0.5 * (2.0 + 0.1 * bias))  # no ratio, decay kept
    q = torch.ones(3, dtype=torch.float64, requires_grad=True)
    opt2 = ReferenceLars([{"params": [q], "lars": False}], lr=0.5, weight_decay=0.1)
    q.grad = torch.full((3,), 2.0, dtype=torch.float64)
    opt2.step()
    torch.testing.assert_close(q.detach(), torch.ones(3, dtype=torch.float64) - 1.0)  # no ratio, no decay


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_computed_in_fp32_and_written_back(dtype):
    p32 = torch.randn(64, generator=torch.Generator().manual_seed(0))
    g32 = torch.randn(64, generator=torch.Generator().manual_seed(1))
    p_lo, g_lo = p32.to(dtype), g32.to(dtype)
    p_ref = p_lo.float()
    m, v = torch.zeros(64), torch.zeros(64)
    reference_adam_step(
        [p_lo],
        [g_lo],
        [m],
        [v],
        [0],
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw_mode=True,
        bias_correction=True,
    )
    reference_adam_step(
        [p_ref],
        [g_lo.float()],
        [torch.zeros(64)],
        [torch.zeros(64)],
        [0],
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw_mode=True,
        bias_correction=True,
    )
    assert p_lo.dtype == dtype and m.dtype == torch.float32
    torch.testing.assert_close(p_lo, p_ref.to(dtype), rtol=0, atol=0)


def test_tensor_steps_are_incremented_in_place():
    steps = [torch.tensor(2.0), 3]
    ps = [torch.ones(2), torch.ones(2)]
    reference_adam_step(
        ps,
        [torch.ones(2)] * 2,
        [torch.zeros(2)] * 2,
        [torch.zeros(2), torch.zeros(2)],
        steps,
        lr=0.1,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw_mode=True,
        bias_correction=True,
    )
    assert float(steps[0]) == 3.0 and steps[1] == 4


def test_mismatched_lists_and_bad_mode_raise():
    with pytest.raises(ValueError, match="one length"):
        reference_sgd_step(
            [torch.ones(1)], [], [None], lr=0.1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0
        )
    with pytest.raises(ValueError, match="bias_correction_mode"):
        reference_lamb_step(
            [],
            [],
            [],
            [],
            [],
            lr=0.1,
            beta1=0.9,
            beta2=0.9,
            eps=1e-6,
            weight_decay=0.0,
            bias_correction_mode="outside",
        )
