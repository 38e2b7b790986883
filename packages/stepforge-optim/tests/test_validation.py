# SPDX-License-Identifier: Apache-2.0
"""Every validation error path of Lamb and Lars: the error type, and a message that names the parameter."""

from __future__ import annotations

import pytest
import torch

from stepforge.core import HyperParameterError
from stepforge.optim import Lamb, Lars


def _p():
    return [torch.zeros(3, requires_grad=True)]


LAMB_BAD = [
    ({"lr": -1.0}, "lr"),
    ({"lr": "0.1"}, "lr"),
    ({"lr": torch.tensor(1)}, "tensor lr must be floating point"),
    ({"lr": torch.tensor([0.1, 0.2])}, "tensor lr must hold one element"),
    ({"lr": torch.tensor(-0.1)}, "lr"),
    ({"betas": (0.9,)}, "betas"),
    ({"betas": (1.0, 0.999)}, r"betas\[0\]"),
    ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
    ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"adam": 1}, "adam"),
    ({"bias_correction": "yes"}, "bias_correction"),
    ({"always_adapt": None}, "always_adapt"),
    ({"adam_w_mode": "False"}, "adam_w_mode"),
    ({"grad_averaging": 0}, "grad_averaging"),
    ({"trust_clip": 10.0}, "trust_clip"),
    ({"trust_clip": "0,10"}, "trust_clip"),
    ({"trust_clip": (0.0, 1.0, 2.0)}, "trust_clip"),
    ({"trust_clip": (-1.0, 1.0)}, "trust_clip low"),
    ({"trust_clip": (0.0, "x")}, "trust_clip high"),
    ({"trust_clip": (2.0, 1.0)}, "low must not exceed high"),
    ({"bias_correction_mode": "outside"}, "bias_correction_mode"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"foreach": "yes"}, "foreach"),
    ({"maximize": 1}, "maximize"),
    ({"differentiable": True}, "differentiable"),
    ({"differentiable": "no"}, "differentiable"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": 2.5}, "chunk_size"),
]

LARS_BAD = [
    ({"lr": -0.1}, "lr"),
    ({"lr": torch.tensor(1)}, "tensor lr must be floating point"),
    ({"lr": torch.tensor(-0.1)}, "lr"),
    ({"momentum": -0.9}, "momentum"),
    ({"dampening": 1.5}, "dampening"),
    ({"weight_decay": -1e-4}, "weight_decay"),
    ({"epsilon": -1.0}, "epsilon"),
    ({"eeta": 0.0}, "eeta"),
    ({"eeta": 1.5}, "eeta"),
    ({"nesterov": True}, "nesterov"),
    ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "nesterov"),
    ({"nesterov": 1, "momentum": 0.9}, "nesterov"),
    ({"grad_clip": 0.0}, "grad_clip"),
    ({"grad_clip": -10.0}, "grad_clip"),
    ({"trust_clip": (50.0, 0.0)}, "low must not exceed high"),
    ({"trust_clip": [0.0]}, "trust_clip"),
    ({"exclude_from_adaptation": "bias"}, "exclude_from_adaptation"),
    ({"foreach": 0}, "foreach"),
    ({"maximize": None}, "maximize"),
    ({"differentiable": True}, "differentiable"),
    ({"chunk_size": -5}, "chunk_size"),
]


@pytest.mark.parametrize(("kwargs", "match"), LAMB_BAD)
def test_lamb_rejects(kwargs, match):
    with pytest.raises(HyperParameterError, match=match) as info:
        Lamb(_p(), **kwargs)
    assert str(info.value).startswith("Lamb:")
    assert isinstance(info.value, ValueError)  # torch.optim code catching ValueError keeps working


@pytest.mark.parametrize(("kwargs", "match"), LARS_BAD)
def test_lars_rejects(kwargs, match):
    with pytest.raises(HyperParameterError, match=match) as info:
        Lars(_p(), **kwargs)
    assert str(info.value).startswith("Lars:")


@pytest.mark.parametrize(
    ("cls", "group", "match"),
    [
        (Lamb, {"lr": -1.0}, "lr"),
        (Lamb, {"trust_clip": (3, 1)}, "trust_clip"),
        (Lamb, {"max_grad_norm": 5.0}, "global"),
        (Lars, {"momentum": -1.0}, "momentum"),
        (Lars, {"lars": "no"}, "lars"),
        (Lars, {"nesterov": True}, "nesterov"),
        (Lamb, {"foreach": "yes"}, "foreach"),
        (Lars, {"maximize": 1}, "maximize"),
        (Lamb, {"differentiable": True}, "differentiable"),
        (Lars, {"chunk_size": 0}, "chunk_size"),
    ],
)
def test_param_group_values_are_validated_and_a_bad_group_is_not_added(cls, group, match):
    opt = cls(_p())
    with pytest.raises(HyperParameterError, match=match):
        opt.add_param_group({"params": _p(), **group})
    assert len(opt.param_groups) == 1
    with pytest.raises(HyperParameterError, match=match):
        cls([{"params": _p()}, {"params": _p(), **group}])


@pytest.mark.parametrize("cls", [Lamb, Lars])
def test_integer_parameters_are_rejected(cls):
    with pytest.raises(HyperParameterError, match="dtype int64"):
        cls([torch.zeros(3, dtype=torch.int64)])


def test_accepted_edge_values():
    Lamb(_p(), lr=0, betas=(0.0, 0.0), eps=0.0, max_grad_norm=0.0, trust_clip=(None, None))
    Lars(_p(), lr=1, eeta=1.0, grad_clip=None, trust_clip=None, nesterov=True, momentum=0.9)


@pytest.mark.parametrize(
    "cls,key,bad",
    [
        ("Lamb", "lr", -1.0),
        ("Lamb", "betas", (0.9, 1.0)),
        ("Lamb", "trust_clip", (3.0, 1.0)),
        ("Lamb", "bias_correction", "False"),
        ("Lars", "lr", -0.1),
        ("Lars", "nesterov", "True"),
        ("Lars", "trust_clip", (None, -1.0)),
    ],
)
def test_an_edited_group_is_refused_at_the_next_step_before_any_update(cls, key, bad):
    import stepforge.optim as optim

    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3)
    opt = getattr(optim, cls)([p], lr=0.1)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0][key] = bad
    with pytest.raises(HyperParameterError, match=rf"{key.split('_')[0]}.*param group #0"):
        opt.step()
    assert torch.equal(p, before)


def test_lamb_load_state_dict_of_other_shapes_fails_naming_the_key_and_changes_nothing():
    from stepforge.optim import Lamb

    small = torch.nn.Parameter(torch.randn(2, 2))
    small.grad = torch.randn(2, 2)
    src = Lamb([small])
    src.step()
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3)
    opt = Lamb([p])
    opt.step()
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match=r"state\['exp_avg'\].*shape \(2, 2\)"):
        opt.load_state_dict(src.state_dict())
    for k, v in before.items():
        assert torch.equal(opt.state[p][k], v) if isinstance(v, torch.Tensor) else opt.state[p][k] == v
