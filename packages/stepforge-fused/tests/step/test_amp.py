# SPDX-License-Identifier: Apache-2.0
"""``_step.eager.plan_unscale``, ``UnscalePlan``, ``_validate.div_scale_divisor``: the division of each step's
gradients (div_scale, GradScaler)."""

from __future__ import annotations

import pytest
import torch

from stepforge.core import HyperParameterError
from stepforge.fused import FusedAdam
from stepforge.fused._step.buckets import Bucket
from stepforge.fused._step.eager import UnscalePlan, plan_unscale, unscale_grads
from stepforge.fused._validate import div_scale_divisor


def _opt():
    return FusedAdam([torch.nn.Parameter(torch.zeros(2))])


def test_div_scale_minus_one_is_no_division_and_bad_values_raise():
    assert div_scale_divisor("FusedAdam", -1) == 1.0 and div_scale_divisor("FusedAdam", None) == 1.0
    assert div_scale_divisor("FusedAdam", 8.0) == 8.0
    for bad in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(HyperParameterError, match="div_scale"):
            div_scale_divisor("FusedAdam", bad)


def test_host_grad_scale_multiplies_the_divisor_and_is_written_back_only_when_alone():
    plan = plan_unscale(_opt(), 2.0, torch.tensor(4.0), torch.tensor(0.0))
    assert (plan.divisor, plan.unscale_by, plan.grad_scale, plan.found_inf, plan.skip) == (
        8.0,
        4.0,
        None,
        None,
        False,
    )
    assert not plan.kernel_writes_back(8.0), "div_scale is in the divisor: a second pass unscales"
    assert plan_unscale(_opt(), 1.0, 4.0, None).kernel_writes_back(4.0)


def test_a_raised_host_found_inf_skips_before_anything_else():
    plan = plan_unscale(_opt(), 1.0, torch.tensor(4.0), torch.tensor(1.0))
    assert plan.skip


def test_device_values_stay_until_the_host_loop_reads_them(monkeypatch):
    opt = _opt()
    monkeypatch.setattr(type(opt), "_device_path", staticmethod(lambda device: True))
    scale, found = torch.tensor(4.0), torch.tensor(0.0)
    plan = plan_unscale(opt, 2.0, scale, found)
    assert plan.grad_scale is scale and plan.found_inf is found and plan.divisor == 2.0
    assert plan.to_host() is False
    assert (plan.divisor, plan.unscale_by, plan.grad_scale) == (8.0, 4.0, None)
    assert UnscalePlan(1.0, found_inf=torch.tensor(1.0)).to_host() is True


def test_non_finite_total_divisor_is_refused():
    with pytest.raises(HyperParameterError, match="positive and finite"):
        UnscalePlan(float("inf")).check_divisor("FusedAdam")
    UnscalePlan(3.0).check_divisor("FusedAdam")


def test_second_pass_divides_every_grad():
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    for p in ps:
        p.grad = torch.full((3,), 6.0)
    b = Bucket(torch.device("cpu"), torch.float32, torch.float32, False)
    b.params = ps
    unscale_grads([b], 3.0)
    assert all(p.grad.tolist() == [2.0, 2.0, 2.0] for p in ps)
