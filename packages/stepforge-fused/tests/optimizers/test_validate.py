# SPDX-License-Identifier: Apache-2.0
"""Strict inputs (``_validate.py`` and the group checks): every bad value is refused where it enters, by name."""

from __future__ import annotations

import math

import pytest
import torch

from stepforge.core import HyperParameterError
from stepforge.fused import CPUAdam, FusedAdam, FusedLAMB, FusedSGD, HybridAdam


def params(n=2):
    return [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]


def with_grads(ps):
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


ADAM_LIKE = [FusedAdam, CPUAdam, HybridAdam, FusedLAMB]
GROUP_CASES = [
    ({"lr": -1e-3}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"betas": (0.9, 1.0)}, r"betas\[1\]"),
    ({"betas": (-0.1, 0.999)}, r"betas\[0\]"),
    ({"betas": 0.9}, "betas"),
    ({"eps": 0.0}, "eps"),
    ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"bias_correction": "False"}, "bias_correction"),
]


@pytest.mark.parametrize("cls", ADAM_LIKE)
@pytest.mark.parametrize("bad,name", GROUP_CASES, ids=[str(c[0]) for c in GROUP_CASES])
def test_bad_group_values_fail_in_init_add_param_group_and_after_an_edit(cls, bad, name):
    # __init__ (constructor keyword or a group dict)
    with pytest.raises(HyperParameterError, match=name):
        cls([{"params": params(), **bad}])
    # add_param_group: refused, nothing added
    opt = cls(params())
    with pytest.raises(HyperParameterError, match=name):
        opt.add_param_group({"params": params(), **bad})
    assert len(opt.param_groups) == 1
    # an edited group fails at the next step, naming the group, before anything is updated
    ps = with_grads(params())
    opt = cls(ps)
    opt.step()
    before = [p.detach().clone() for p in ps]
    opt.param_groups[0].update(bad)
    with pytest.raises(HyperParameterError, match=rf"{name}.*param group #0"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before, strict=True))


@pytest.mark.parametrize(
    "cls,flag", [(FusedAdam, "adamw_mode"), (CPUAdam, "adamw_mode"), (FusedLAMB, "adam_w_mode")]
)
def test_string_booleans_are_refused(cls, flag):
    with pytest.raises(HyperParameterError, match=flag):
        cls(params(), **{flag: "False"})
    opt = cls(with_grads(params()))
    opt.param_groups[0][flag] = "False"
    with pytest.raises(HyperParameterError, match=flag):
        opt.step()


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(lr=-0.1), "lr"),
        (dict(lr=0.1, momentum=-0.9), "momentum"),
        (dict(lr=0.1, dampening=1.5), "dampening"),
        (dict(lr=0.1, nesterov=True), "nesterov=True requires momentum"),
        (dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov=True requires momentum"),
        (dict(lr=0.1, nesterov="True"), "nesterov"),
    ],
)
def test_sgd_bad_values(kw, name):
    with pytest.raises(HyperParameterError, match=name):
        FusedSGD(params(), **kw)
    opt = FusedSGD(params(), lr=0.1)
    with pytest.raises(HyperParameterError, match=name):
        opt.add_param_group({"params": params(), **kw})


def test_sgd_nesterov_switched_on_a_group_without_momentum_fails_at_step():
    opt = FusedSGD(with_grads(params()), lr=0.1)
    opt.param_groups[0]["nesterov"] = True
    with pytest.raises(HyperParameterError, match="nesterov=True requires momentum"):
        opt.step()


@pytest.mark.parametrize(
    "trust_clip,match",
    [
        ((2.0, 1.0), "low must not exceed high"),
        ((1.0,), "two bounds"),
        ("0,1", "pair"),
        ((-1.0, None), "low"),
    ],
)
def test_lamb_trust_clip_bad_tuples(trust_clip, match):
    with pytest.raises(HyperParameterError, match=match):
        FusedLAMB(params(), trust_clip=trust_clip)
    opt = FusedLAMB(params())
    with pytest.raises(HyperParameterError, match=match):
        opt.add_param_group({"params": params(), "trust_clip": trust_clip})


def test_lamb_trust_clip_none_parts_are_unbounded_in_groups_too():
    opt = FusedLAMB(params(), trust_clip=(None, 5.0))
    opt.add_param_group({"params": params(), "trust_clip": (0.5, None)})
    assert opt.param_groups[0]["trust_clip"] == (0.0, 5.0)
    assert opt.param_groups[1]["trust_clip"] == (0.5, math.inf)


def test_lamb_max_grad_norm_on_a_group_is_refused_because_it_would_be_ignored():
    with pytest.raises(HyperParameterError, match="max_grad_norm.*global norm"):
        FusedLAMB([{"params": params(), "max_grad_norm": 5.0}], max_grad_norm=1.0)
    opt = FusedLAMB(params(), max_grad_norm=1.0)
    with pytest.raises(HyperParameterError, match="max_grad_norm"):
        opt.add_param_group({"params": params(), "max_grad_norm": 0.0})
    FusedLAMB([{"params": params(), "max_grad_norm": 1.0}], max_grad_norm=1.0)  # the same value is fine


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedLAMB, CPUAdam])
def test_fp64_and_non_contiguous_params_fail_at_construction_saying_what_to_do(cls):
    kw = {"lr": 0.1} if cls is FusedSGD else {}
    with pytest.raises(TypeError, match=r"float64.*model.float\(\)"):
        cls([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))], **kw)
    with pytest.raises(RuntimeError, match="not contiguous.*contiguous\\(\\)"):
        cls([torch.nn.Parameter(torch.randn(4, 6).t())], **kw)
    opt = cls(params(), **kw)
    with pytest.raises(TypeError, match="float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -2.0, float("inf")])
def test_div_scale_nan_zero_negative_are_errors(bad):
    opt = CPUAdam(with_grads(params()))
    with pytest.raises(HyperParameterError, match="div_scale"):
        opt.step(div_scale=bad)


def test_div_scale_minus_one_is_no_division():
    a = with_grads(params())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        q.grad = p.grad.clone()
    CPUAdam(a, lr=1e-2).step(div_scale=-1)
    CPUAdam(b, lr=1e-2).step()
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_sgd_state_into_fused_adam_fails_at_load_naming_the_key_and_changes_nothing():
    ps = with_grads(params())
    sgd = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    sgd.step()
    opt = FusedAdam(ps, lr=1e-2)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    groups_before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match="'momentum_buffer'.*another optimizer"):
        opt.load_state_dict(sgd.state_dict())
    assert all(torch.equal(opt.state[ps[0]][k], v) for k, v in before.items())
    assert [dict(g) for g in opt.param_groups] == groups_before


def test_adam_state_into_fused_sgd_fails_at_load():
    ps = with_grads(params())
    adam = torch.optim.AdamW(ps)
    adam.step()
    with pytest.raises(ValueError, match="'exp_avg'"):
        FusedSGD(ps, lr=0.1, momentum=0.9).load_state_dict(adam.state_dict())


def test_state_of_other_shapes_fails_at_load_naming_the_key():
    small = with_grads([torch.nn.Parameter(torch.randn(2, 2))])
    src = FusedAdam(small)
    src.step()
    with pytest.raises(ValueError, match=r"state\['exp_avg'\].*shape \(2, 2\)"):
        FusedAdam([torch.nn.Parameter(torch.randn(4, 3))]).load_state_dict(src.state_dict())


def test_torch_user_mistakes_wrong_group_count_and_sizes():
    ps = with_grads(params(3))
    src = FusedAdam(ps)
    src.step()
    with pytest.raises(ValueError, match="param groups"):
        FusedAdam([{"params": ps[:1]}, {"params": ps[1:]}]).load_state_dict(src.state_dict())
    with pytest.raises(ValueError, match="parameters"):
        FusedAdam(ps[:2]).load_state_dict(src.state_dict())


def test_loaded_groups_are_validated():
    ps = with_grads(params())
    src = torch.optim.AdamW(ps, lr=1e-3)
    sd = src.state_dict()
    sd["param_groups"][0]["betas"] = (0.9, 1.5)
    with pytest.raises(HyperParameterError, match=r"betas\[1\]"):
        FusedAdam(ps).load_state_dict(sd)
