# SPDX-License-Identifier: Apache-2.0
"""FusedSGD and FusedLAMB: parity with torch.optim.SGD, stepforge-optim's Lamb and the references."""

from __future__ import annotations

import io

import pytest
import torch

from stepforge.core import HyperParameterError, build_optimizer
from stepforge.fused import FusedLAMB, FusedSGD
from stepforge.optim import Lamb
from stepforge.testing.reference import ReferenceLamb, ReferenceSGD
from stepforge.testing.tensors import clone_params, set_grads

SHAPES = [(3, 5), (17,), (1,), (0,), (40, 33), (1031,)]


def make_params(dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]


def close(a, b, **tol):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.detach().float(), y.detach().float(), **tol)


def roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(lr=0.1),
        dict(lr=0.1, momentum=0.9, weight_decay=0.01),
        dict(lr=0.05, momentum=0.9, dampening=0.3),
        dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
    ],
    ids=["plain", "momentum-wd", "dampening", "nesterov"],
)
def test_sgd_matches_torch_sgd(isa, cfg):
    ours = make_params()
    ref = clone_params(ours)
    opt = FusedSGD(ours, **cfg)
    torch_opt = torch.optim.SGD(ref, **cfg)
    for _ in range(4):
        set_grads(ours, ref)
        opt.step()
        torch_opt.step()
    close(ours, ref, rtol=1e-6, atol=1e-6)
    if cfg.get("momentum"):
        assert "step" not in opt.state[ours[0]]
        close(
            [opt.state[p]["momentum_buffer"] for p in ours],
            [torch_opt.state[q]["momentum_buffer"] for q in ref],
            rtol=1e-6,
            atol=1e-6,
        )


def test_sgd_wd_after_momentum_first_step_per_parameter_and_masters():
    ours = make_params(torch.bfloat16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = FusedSGD(ours, lr=0.1, momentum=0.9, weight_decay=0.01, wd_after_momentum=True, master_weights=True)
    ref = ReferenceSGD(fp32, lr=0.1, momentum=0.9, weight_decay=0.01, wd_after_momentum=True)
    for k in range(4):
        set_grads(ours)
        for p, q in zip(ours, fp32, strict=True):
            q.grad = p.grad.float()
        if k < 2:  # parameter 0 joins late: its buffer is initialised from its own first grad
            ours[0].grad = None
            fp32[0].grad = None
        opt.step()
        ref.step()
    close([opt.state[p]["master_param"] for p in ours], fp32, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16)) for p in ours)


def test_sgd_state_dict_interop_with_torch():
    ours = make_params()
    ref = clone_params(ours)
    torch_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    set_grads(ref)
    torch_opt.step()
    with torch.no_grad():
        for p, q in zip(ours, ref, strict=True):
            p.copy_(q)
    opt = FusedSGD(ours, lr=1.0, momentum=0.5)
    opt.load_state_dict(roundtrip(torch_opt.state_dict()))
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["wd_after_momentum"] is False
    for _ in range(2):
        set_grads(ours, ref)
        opt.step()
        torch_opt.step()
    close(ours, ref, rtol=1e-6, atol=1e-6)
    back = clone_params(ours)
    torch_back = torch.optim.SGD(back, lr=3.0)
    torch_back.load_state_dict(roundtrip(opt.state_dict()))
    set_grads(ours, back)
    opt.step()
    torch_back.step()
    close(ours, back, rtol=1e-6, atol=1e-6)


def test_sgd_errors():
    with pytest.raises(HyperParameterError, match="lr is required"):
        FusedSGD(make_params())
    with pytest.raises(HyperParameterError, match="nesterov=True requires momentum > 0"):
        FusedSGD(make_params(), lr=0.1, nesterov=True)
    with pytest.raises(HyperParameterError, match="momentum"):
        FusedSGD(make_params(), lr=0.1, momentum=-1)
    assert type(build_optimizer(dict(type="FusedSGD", lr=0.1), make_params())) is FusedSGD


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(weight_decay=0.0),
        dict(weight_decay=0.0, use_nvlamb=True),
        dict(adam_w_mode=False),
        dict(max_grad_norm=0.0, bias_correction=False),
        dict(grad_averaging=False, max_grad_norm=100.0),
    ],
    ids=["defaults", "no-decay", "nvlamb", "l2", "no-clip-no-bc", "no-averaging"],
)
def test_lamb_matches_stepforge_optim_lamb(isa, cfg):
    ours = make_params()
    ref = clone_params(ours)
    opt = FusedLAMB(ours, lr=1e-2, **cfg)
    ref_opt = Lamb.fused_lamb(ref, lr=1e-2, **cfg)
    for _ in range(3):
        set_grads(ours, ref)
        opt.step()
        ref_opt.step()
    close(ours, ref, rtol=1e-5, atol=1e-6)


def test_lamb_global_clip_spans_groups_trust_clip_and_div_scale():
    ours = make_params()
    ref = clone_params(ours)
    opt = FusedLAMB(
        [{"params": ours[:3]}, {"params": ours[3:], "weight_decay": 0.1}],
        lr=1e-2,
        max_grad_norm=0.5,
        trust_clip=(0.5, 2.0),
    )
    ref_opt = ReferenceLamb(
        [{"params": ref[:3]}, {"params": ref[3:], "weight_decay": 0.1}],
        lr=1e-2,
        max_grad_norm=0.5,
        trust_clip=(0.5, 2.0),
        weight_decay=0.01,
        bias_correction=True,
    )
    for _ in range(3):
        set_grads(ours, ref)
        for p in ours:
            p.grad *= 4.0
        opt.step(div_scale=4.0)
        ref_opt.step()
    close(ours, ref, rtol=1e-5, atol=1e-6)


def test_lamb_master_weights_and_grads_untouched():
    ours = make_params(torch.float16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = FusedLAMB(ours, lr=1e-2, master_weights=True)
    ref_opt = Lamb.fused_lamb(fp32, lr=1e-2)
    for _ in range(3):
        set_grads(ours)
        grads_before = [p.grad.clone() for p in ours]
        for p, q in zip(ours, fp32, strict=True):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads_before, strict=True))
    close([opt.state[p]["master_param"] for p in ours], fp32, rtol=1e-5, atol=1e-6)


def test_lamb_errors():
    with pytest.raises(HyperParameterError, match="amsgrad"):
        FusedLAMB(make_params(), amsgrad=True)
    with pytest.raises(HyperParameterError, match="trust_clip"):
        FusedLAMB(make_params(), trust_clip=(2.0, 1.0))
    with pytest.raises(HyperParameterError, match="max_grad_norm"):
        FusedLAMB(make_params(), max_grad_norm=-1.0)
    assert type(build_optimizer(dict(type="FusedLAMB", lr=1e-3), make_params())) is FusedLAMB


def test_lamb_non_finite_grads_skip_or_propagate():
    ours = make_params()
    opt = FusedLAMB(ours, lr=1e-2, skip_nonfinite=True)
    set_grads(ours)
    ours[1].grad[0] = float("inf")
    before = [p.detach().clone() for p in ours]
    opt.step()
    assert opt.last_step_skipped and all(torch.equal(p, b) for p, b in zip(ours, before, strict=True))
    opt2 = FusedLAMB(ours, lr=1e-2)  # apex behaviour: NaN/inf propagate into the update, no exception
    opt2.step()
    assert not torch.isfinite(ours[1]).all()


def test_a_pickled_lamb_steps_as_the_original():
    """A pickle round trip (also how ``copy.copy`` copies an optimizer) rebuilds the sharded-norm caches it does
    not pickle: the copy's next step equals the original's."""
    import pickle

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = FusedLAMB(params, lr=1e-2)
    set_grads(params)
    opt.step()
    twin = pickle.loads(pickle.dumps(opt))
    twin_params = twin.param_groups[0]["params"]
    for mine, theirs in zip(params, twin_params, strict=True):
        theirs.grad = mine.grad.clone()
    opt.step()
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True))
