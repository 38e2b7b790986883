# SPDX-License-Identifier: Apache-2.0
"""build_optimizer over every accepted input form, and its errors."""

from __future__ import annotations

import pytest
import torch

from stepforge.core import OPTIMIZERS, HyperParameterError, UnknownNameError, build_optimizer


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _same_params(optimizer: torch.optim.Optimizer, expected: list[torch.Tensor]) -> bool:
    got = [p for group in optimizer.param_groups for p in group["params"]]
    return len(got) == len(expected) and all(a is b for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("kind", ["AdamW", "adamw", "adam_w", torch.optim.AdamW])
def test_type_as_name_or_class(model, kind):
    optimizer = build_optimizer(dict(type=kind, lr=0.01, weight_decay=0.1), model)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["lr"] == 0.01 and optimizer.defaults["weight_decay"] == 0.1


@pytest.mark.parametrize("form", ["module", "list", "generator", "tuple"])
def test_params_forms(model, form):
    params = list(model.parameters())
    given = {
        "module": model,
        "list": params,
        "generator": model.parameters(),
        "tuple": tuple(params),
    }[form]
    optimizer = build_optimizer(dict(type="SGD", lr=0.1), given)
    assert _same_params(optimizer, params)


def test_param_groups_keep_per_group_options(model):
    first, second = model[0], model[2]
    groups = [{"params": first.parameters(), "lr": 0.5}, {"params": list(second.parameters())}]
    optimizer = build_optimizer(dict(type="SGD", lr=0.1, momentum=0.9), groups)
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.1]
    assert all(g["momentum"] == 0.9 for g in optimizer.param_groups)


def test_built_optimizer_steps_like_a_direct_one(model):
    clone = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    clone.load_state_dict(model.state_dict())
    built = build_optimizer(dict(type="adam", lr=0.01), model)
    direct = torch.optim.Adam(clone.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    for net, opt in ((model, built), (clone, direct)):
        for _ in range(3):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_optimizer_instance_passes_through(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert build_optimizer(optimizer) is optimizer
    with pytest.raises(HyperParameterError, match="params=None"):
        build_optimizer(optimizer, model)


def test_registered_class_is_buildable(model):
    class Custom(torch.optim.SGD):
        pass

    OPTIMIZERS.register("test-custom-sgd", Custom)
    try:
        assert type(build_optimizer({"type": "TestCustomSGD", "lr": 0.1}, model)) is Custom
    finally:
        OPTIMIZERS.unregister("test-custom-sgd")


def test_the_config_is_not_mutated(model):
    cfg = dict(type="SGD", lr=0.1)
    build_optimizer(cfg, model)
    assert cfg == dict(type="SGD", lr=0.1)


@pytest.mark.parametrize(
    ("cfg", "params", "match"),
    [
        (dict(lr=0.1), "model", "no 'type' key"),
        (dict(type="SGD", lr=0.1), None, "params is required"),
        (dict(type="SGD", lr=0.1), [], "empty parameter list"),
        (dict(type="SGD", lr=0.1), "tensor", "wrap it in a list"),
        (dict(type="SGD", lr=0.1), "mixed", "both tensors and dicts"),
        (dict(type="SGD", lr=0.1), [1.0], "item of type float"),
        (dict(type="SGD", lr=0.1), [{"lr": 0.1}], "param group 0 has no 'params'"),
        (dict(type="SGD", lr=0.1), "bad-group-lr", r"param group 0.*invalid lr=-2"),
        (dict(type="SGD", lr=-1.0), "model", r"SGD: invalid lr=-1.0; lr must be in \[0, inf\)"),
        (dict(type="Adam", betas=(0.9, 1.0)), "model", r"invalid betas\[1\]=1.0"),
        (dict(type=3), "model", "'type' must be a name or an optimizer class"),
        ("AdamW", "model", "cfg must be a dict"),
        (dict(type="SGD", lr=0.1), "not params", "got str"),
    ],
)
def test_errors_name_the_problem(model, cfg, params, match):
    weight = next(model.parameters())
    given = (
        {
            "model": model,
            "tensor": weight,
            "mixed": [weight, {"params": [weight]}],
            "bad-group-lr": [{"params": [weight], "lr": -2}],
        }.get(params, params)
        if isinstance(params, str)
        else params
    )
    with pytest.raises(HyperParameterError, match=match):
        build_optimizer(cfg, given)


def test_unknown_type_is_a_clear_lookup_error(model):
    with pytest.raises(UnknownNameError, match="Available: .*AdamW"):
        build_optimizer(dict(type="NoSuchOptimizer"), model)
