# SPDX-License-Identifier: Apache-2.0
"""Validation helpers: accepted values pass through, every rejection names the parameter and the range."""

from __future__ import annotations

import math

import pytest
import torch

from stepforge.core import (
    HyperParameterError,
    check_betas,
    check_bool,
    check_dampening,
    check_eps,
    check_float_dtype,
    check_grad,
    check_lr,
    check_momentum,
    check_positive_int,
    check_range,
    check_weight_decay,
    validate_hyperparameters,
)


@pytest.mark.parametrize(
    ("check", "value", "expected"),
    [
        (check_lr, 0, 0.0),
        (check_lr, 1e-3, 1e-3),
        (check_lr, torch.tensor(0.5), 0.5),
        (check_eps, 1e-8, 1e-8),
        (check_weight_decay, 0.01, 0.01),
        (check_momentum, 0.9, 0.9),
        (check_dampening, 1, 1.0),
    ],
)
def test_valid_values_come_back_as_floats(check, value, expected):
    assert check(value) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("check", "value", "message"),
    [
        (check_lr, -0.1, r"invalid lr=-0.1; lr must be in \[0, inf\)\. Pass a non-negative learning rate\."),
        (check_lr, math.nan, r"invalid lr=nan; lr must be in \[0, inf\)"),
        (check_lr, "0.1", r"invalid lr='0.1'; lr must be a real number, got str"),
        (check_lr, True, r"lr must be a real number, got bool"),
        (check_lr, torch.ones(2), r"a tensor lr must hold one element, got shape \(2,\)"),
        (check_eps, -1e-8, r"invalid eps=-1e-08; eps must be in \[0, inf\)"),
        (check_weight_decay, -1, r"weight_decay must be in \[0, inf\)\. Use 0 to disable weight decay\."),
        (check_momentum, -0.5, r"momentum must be in \[0, inf\)"),
        (check_dampening, 1.5, r"dampening must be in \[0, 1\]"),
    ],
)
def test_invalid_values_name_parameter_and_range(check, value, message):
    with pytest.raises(HyperParameterError, match=message):
        check(value, owner="Opt")
    with pytest.raises(ValueError, match=r"^Opt: "):
        check(value, owner="Opt")


@pytest.mark.parametrize(
    ("betas", "message"),
    [
        ((0.9, 1.0), r"invalid betas\[1\]=1.0; betas\[1\] must be in \[0, 1\)"),
        ((-0.1, 0.9), r"invalid betas\[0\]=-0.1"),
        (0.9, r"betas must be a pair \(beta1, beta2\)"),
        ((0.9,), r"betas must be a pair"),
        ("ab", r"betas must be a pair"),
    ],
)
def test_betas(betas, message):
    with pytest.raises(HyperParameterError, match=message):
        check_betas(betas)


def test_betas_ok():
    assert check_betas([0.9, 0.999]) == (0.9, 0.999)


def test_range_with_open_bounds_and_hint():
    assert check_range("eeta", 1.0, low=0, high=1, low_open=True) == 1.0
    with pytest.raises(HyperParameterError, match=r"eeta must be in \(0, 1\]\. Pick a small value\.$"):
        check_range("eeta", 0.0, low=0, high=1, low_open=True, hint="Pick a small value.")
    with pytest.raises(HyperParameterError, match=r"x must be in \(-inf, 2\)"):
        check_range("x", 2, high=2, high_open=True)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_positive_int(value):
    with pytest.raises(HyperParameterError, match=r"accumulative_counts must be an integer >= 1"):
        check_positive_int("accumulative_counts", value)


def test_positive_int_ok():
    assert check_positive_int("n", 3) == 3


def test_bool():
    assert check_bool("adamw_mode", False) is False
    with pytest.raises(HyperParameterError, match="adamw_mode must be True or False"):
        check_bool("adamw_mode", "False")


def test_grad_checks():
    param = torch.zeros(3, 2, requires_grad=True)
    check_grad(param)  # no grad: nothing to check
    param.grad = torch.zeros(3, 2)
    check_grad(param)
    param.grad = torch.zeros(3, 2).to_sparse()
    with pytest.raises(HyperParameterError, match=r"Lamb: got a sparse gradient .* torch.optim.SparseAdam"):
        check_grad(param, owner="Lamb")
    check_grad(param, allow_sparse=True)


def test_grad_shape_mismatch():
    param = torch.zeros(3, 2)
    # autograd forbids assigning a mismatched grad, so build the mismatch with a stand-in object
    fake = type("P", (), {"grad": torch.zeros(2, 3), "shape": param.shape, "device": param.device})()
    with pytest.raises(
        HyperParameterError, match=r"gradient shape \(2, 3\) does not match parameter shape \(3, 2\)"
    ):
        check_grad(fake)


def test_float_dtype():
    check_float_dtype("param", torch.zeros(1, dtype=torch.bfloat16))
    with pytest.raises(
        HyperParameterError, match=r"param has dtype float64; supported dtypes are float32, float16"
    ):
        check_float_dtype("param", torch.zeros(1, dtype=torch.float64), owner="FusedAdam")


def test_validate_hyperparameters_checks_known_keys_only():
    validate_hyperparameters({"lr": 0.1, "betas": (0.9, 0.99), "custom": -5, "momentum": None})
    with pytest.raises(HyperParameterError, match="Lars: invalid weight_decay=-1"):
        validate_hyperparameters({"weight_decay": -1}, owner="Lars")


def test_nesterov_needs_momentum_and_no_dampening():
    from stepforge.core import check_nesterov

    assert check_nesterov(True, 0.9, 0.0) is True
    assert check_nesterov(False, 0.0) is False
    for momentum, dampening in ((0.0, 0.0), (0.9, 0.1)):
        with pytest.raises(HyperParameterError, match="nesterov=True requires momentum > 0"):
            check_nesterov(True, momentum, dampening, owner="SGD")
    with pytest.raises(HyperParameterError, match="nesterov"):
        check_nesterov("True", 0.9)


@pytest.mark.parametrize(
    "value,match",
    [((2.0, 1.0), "low must not exceed high"), ((1.0,), "two bounds"), ("01", "pair"), ((None, -1), "high")],
)
def test_trust_clip_bad(value, match):
    from stepforge.core import check_trust_clip

    with pytest.raises(HyperParameterError, match=match):
        check_trust_clip(value, owner="Lamb")


def test_trust_clip_ok():
    from stepforge.core import check_trust_clip

    assert check_trust_clip(None) is None
    assert check_trust_clip((None, 3)) == (None, 3.0)
    assert check_trust_clip([0.5, 0.5]) == (0.5, 0.5)


def test_group_validator_checks_on_entry_and_only_edited_groups_later():
    from stepforge.core import GroupValidator, check_lr

    calls = []

    def check(group):
        calls.append(group["lr"])
        check_lr(group["lr"], owner="Opt")

    v = GroupValidator(check, owner="Opt")
    groups = [{"params": [], "lr": 0.1}, {"params": [], "lr": 0.2}]
    for i, g in enumerate(groups):
        v.validate(g, i)
    assert calls == [0.1, 0.2]
    v.revalidate(groups)
    assert calls == [0.1, 0.2], "unchanged groups are not re-checked"
    groups[1]["lr"] = 0.3
    v.revalidate(groups)
    assert calls == [0.1, 0.2, 0.3]
    groups[0]["lr"] = -1.0
    with pytest.raises(HyperParameterError, match=r"lr=-1.0.*\(param group #0\)"):
        v.revalidate(groups)
    groups[0]["lr"] = 0.1
    groups[0]["new_key"] = True  # a key added counts as an edit
    v.revalidate(groups)
    assert calls[-1] == 0.1
    groups.append({"params": [], "lr": 0.5})  # a group never seen is checked
    v.revalidate(groups)
    assert calls[-1] == 0.5
