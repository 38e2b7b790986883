# SPDX-License-Identifier: Apache-2.0
"""The helpers of compiled-step tests: paired gradients, bit and ulp comparisons, and the allocation peak."""

from __future__ import annotations

import torch

from stepforge.testing.compiled import (
    lambda_schedule,
    peak_transient_bytes,
    resident_bytes,
    same_bits,
    scale_ulps,
    set_grads,
)


def test_set_grads_gives_equal_values_in_distinct_tensors():
    """Both lists get the same values, never the same tensor (an in-place op on one must not reach the other)."""
    a = [torch.zeros(3, 2), torch.zeros(4)]
    b = [torch.zeros(3, 2), torch.zeros(4)]
    set_grads([a, b], 7)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.grad, y.grad) and x.grad is not y.grad
        assert x.grad.data_ptr() != y.grad.data_ptr()
    before = a[0].grad.clone()
    set_grads([a, b], 8)
    assert not torch.equal(before, a[0].grad)


def test_same_bits_treats_nans_as_equal_and_dtypes_as_different():
    x = torch.tensor([1.0, float("nan"), -0.0])
    assert same_bits(x, x.clone())
    assert not same_bits(x, torch.tensor([1.0, 0.0, -0.0]))
    assert not same_bits(x, x.double())


def test_scale_ulps_counts_units_of_the_largest_magnitude():
    """Near 1.0 the float32 spacing is 2**-23: one step there is one ulp; a step of 2**-22 on an element of 0.01
    is two ulps of the tensor's scale, however many ulps of 0.01 it is."""
    a = torch.tensor([1.5, 0.01], dtype=torch.float32)
    b = a.clone()
    assert scale_ulps(a, b) == 0.0
    b[0] = torch.nextafter(a[0], torch.tensor(2.0))
    assert scale_ulps(a, b) == 1.0
    b = a.clone()
    b[1] += 2.0**-22
    assert scale_ulps(a, b) == 2.0


def test_peak_transient_bytes_sees_a_temporary_and_not_a_kept_tensor():
    """A 4 MB temporary freed inside the call counts; allocations kept from before do not (an in-place add
    allocates only its scalar's few bytes)."""
    kept = torch.zeros(1 << 20)

    def step():
        tmp = kept * 2
        del tmp

    assert (1 << 22) <= peak_transient_bytes(step) < (1 << 22) + 4096
    assert peak_transient_bytes(lambda: kept.add_(1)) < 64


def test_resident_bytes_counts_params_grads_and_state():
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.zeros(10)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    assert resident_bytes(opt) == 80
    opt.step()
    assert resident_bytes(opt) == 120  # the momentum buffer


def test_lambda_schedule_changes_the_lr_every_step():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    (sched,) = lambda_schedule([opt], decay=0.5)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
