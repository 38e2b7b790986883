# SPDX-License-Identifier: Apache-2.0
"""Step routing of ``FusedOptimizerBase`` (``_base.py``): what ``p.grad`` holds after a GradScaler step.

torch's contract (``torch.optim.AdamW(fused=True)``/``SGD(fused=True)`` with ``grad_scale``/``found_inf``): a step
that runs leaves ``p.grad = g_scaled / scale``; a step skipped by ``found_inf`` changes nothing, grads included.
References: torch's fused optimizers driven with the same attributes, and exact expected values (a power-of-two
scale divides exactly, so ``(g * 1024) / 1024 == g`` bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from stepforge.fused import CPUAdam, FusedAdam, FusedLAMB, FusedSGD, HybridAdam
from stepforge.testing.tensors import bits_equal, clone_params, make_params

SHAPES = [(3, 5), (17,), (1,), (40, 33), (1031,)]
SCALE = 1024.0


def make(dtype=torch.float32, seed=0):
    return make_params(SHAPES, dtype, seed=seed)


def scaled_grads(params, seed=1, scale=SCALE):
    gen = torch.Generator().manual_seed(seed)
    raw = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
    return raw, [g * scale for g in raw]


def amp_step(opt, found_inf=0.0, scale=SCALE):
    opt.grad_scale = torch.tensor(scale)
    opt.found_inf = torch.tensor(found_inf)
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf


ADAMS = [FusedAdam, CPUAdam, HybridAdam]


@pytest.mark.parametrize("cls", ADAMS)
def test_adam_leaves_unscaled_grads_like_torch_fused_adamw(cls):
    ours = make()
    ref = clone_params(ours)
    opt = cls(ours, lr=1e-2, weight_decay=0.01)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, fused=True)
    for k in range(3):
        _, scaled = scaled_grads(ours, seed=k, scale=3.0 if k == 2 else SCALE)  # 3: not a power of two
        for p, q, g in zip(ours, ref, scaled, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        amp_step(opt, scale=3.0 if k == 2 else SCALE)
        amp_step(torch_opt, scale=3.0 if k == 2 else SCALE)
        assert bits_equal([p.grad for p in ours], [q.grad for q in ref]), f"grads, step {k}"
        assert bits_equal(ours, ref), f"params, step {k}"


@pytest.mark.parametrize("cls", [*ADAMS, FusedLAMB, FusedSGD])
def test_a_step_skipped_by_found_inf_leaves_grads_scaled_as_torch_does(cls):
    ours = make()
    opt = cls(ours, lr=1e-2) if cls is not FusedSGD else cls(ours, lr=0.1, momentum=0.9)
    _, scaled = scaled_grads(ours)
    for p, g in zip(ours, scaled, strict=True):
        p.grad = g.clone()
    before = [p.detach().clone() for p in ours]
    amp_step(opt, found_inf=1.0)
    assert bits_equal([p.grad for p in ours], scaled)
    assert bits_equal(ours, before)
    assert opt.last_step_skipped


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_leaves_unscaled_grads_like_torch_fused_sgd(momentum):
    ours = make()
    ref = clone_params(ours)
    opt = FusedSGD(ours, lr=0.1, momentum=momentum, weight_decay=0.01)
    torch_opt = torch.optim.SGD(ref, lr=0.1, momentum=momentum, weight_decay=0.01, fused=True)
    for k in range(2):
        _, scaled = scaled_grads(ours, seed=k)
        for p, q, g in zip(ours, ref, scaled, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        amp_step(opt)
        amp_step(torch_opt)
        assert bits_equal([p.grad for p in ours], [q.grad for q in ref]), f"grads, step {k}"
        # FusedSGD's momentum update is not bit-identical to torch's (optimizers/test_sgd_lamb.py: same tolerance)
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e-3], ids=["no-clip", "clip"])
def test_lamb_leaves_unscaled_grads_and_steps_as_without_scaling(max_grad_norm):
    # the clip case divides by scale x clip in the kernel, so the grads are unscaled in a second pass
    ours = make()
    ref = clone_params(ours)
    opt = FusedLAMB(ours, lr=1e-2, max_grad_norm=max_grad_norm)
    plain = FusedLAMB(ref, lr=1e-2, max_grad_norm=max_grad_norm)
    for k in range(2):
        raw, scaled = scaled_grads(ours, seed=k)
        for p, q, g, s in zip(ours, ref, raw, scaled, strict=True):
            p.grad, q.grad = s.clone(), g.clone()
        amp_step(opt)
        plain.step()
        assert bits_equal([p.grad for p in ours], raw), f"grads, step {k}"
        assert bits_equal(ours, ref), f"params, step {k}"


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedLAMB])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weight_path_leaves_unscaled_low_precision_grads(cls, dtype):
    ours = make(dtype)
    kw = dict(lr=0.1, momentum=0.9) if cls is FusedSGD else dict(lr=1e-2)
    opt = cls(ours, master_weights=True, **kw)
    raw, scaled = scaled_grads(ours)
    for p, s in zip(ours, scaled, strict=True):
        p.grad = s.clone()
    amp_step(opt)
    assert not opt.last_step_skipped
    assert bits_equal([p.grad for p in ours], raw)


def test_grad_scaler_step_leaves_the_same_grads_as_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ref.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16) for _ in range(2)]
    x = torch.randn(4, 8)
    for _ in range(3):
        for m, o, s in ((model, opt, scalers[0]), (ref, torch_opt, scalers[1])):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
            s.step(o)
            s.update()
        assert bits_equal([p.grad for p in model.parameters()], [q.grad for q in ref.parameters()])
        assert bits_equal(model.parameters(), ref.parameters())


def test_div_scale_alone_leaves_grads_untouched_and_with_grad_scale_unscales_by_the_scale_only():
    ours = make()
    opt = CPUAdam(ours, lr=1e-2)
    raw, scaled = scaled_grads(ours)
    for p, s in zip(ours, scaled, strict=True):
        p.grad = s.clone()
    opt.step(div_scale=SCALE)  # ColossalAI's contract: grads are read, never written
    assert bits_equal([p.grad for p in ours], scaled)
    opt.grad_scale, opt.found_inf = torch.tensor(SCALE), torch.tensor(0.0)
    opt.step(div_scale=2.0)
    assert bits_equal([p.grad for p in ours], raw)
