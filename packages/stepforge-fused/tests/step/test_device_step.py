# SPDX-License-Identifier: Apache-2.0
"""``_device_step`` helpers checked on the CPU with a stand-in for the ``_cuda`` module (no device needed), and the
device-step helpers of ``stepforge.testing.fused_cuda``."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from stepforge.fused._step.device import clip_divisor_from_sumsq, device_grad_sumsq
from stepforge.testing import fused_cuda


class FakeCuda:
    """Implements ``l2norm(..., sumsq_out_ptr=)`` on CPU tensors found by address, as the CUDA module would."""

    def __init__(self, tensors):
        self.by_ptr = {t.data_ptr(): t for t in tensors}

    def l2norm(self, ptrs, sizes, dtype, per_tensor_out_ptr, ctx, *, sumsq_out_ptr=0, device=-1):
        total = sum(float(self.by_ptr[p].double().pow(2).sum()) for p in ptrs)
        out = ctypes.c_float.from_address(sumsq_out_ptr)
        out.value = out.value + total
        return None


def _bucket(ts):
    return [t.data_ptr() for t in ts], [t.numel() for t in ts], 0


@pytest.mark.parametrize("max_norm", [0.0, 1.0, 1e6])
def test_device_clip_divisor_matches_host_formula(max_norm):
    a = [torch.randn(10), torch.randn(3, 4)]
    b = [torch.randn(7)]
    fake = FakeCuda(a + b)
    sumsq = device_grad_sumsq(fake, [_bucket(a), _bucket(b)], device=torch.device("cpu"), ctx=0)
    div, found = clip_divisor_from_sumsq(sumsq, divisor=8.0, max_norm=max_norm)
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in a + b)) / 8.0
    expect = 8.0 * (max(1.0, norm / max_norm) if max_norm > 0 else 1.0)
    assert div.item() == pytest.approx(expect, rel=1e-6)
    assert found.item() == 0.0


def test_device_clip_divisor_flags_overflow():
    a = [torch.randn(10), torch.tensor([1.0, float("inf")])]
    sumsq = device_grad_sumsq(FakeCuda(a), [_bucket(a)], device=torch.device("cpu"), ctx=0)
    div, found = clip_divisor_from_sumsq(sumsq, divisor=2.0, max_norm=1.0)
    assert found.item() == 1.0
    assert div.item() == 2.0


def test_device_step_helpers_validate_and_count():
    with pytest.raises(ValueError, match="0-dim float32 CUDA tensor"):
        fused_cuda.device_step_ptrs([torch.zeros(())])
    steps = [torch.zeros(()), torch.full((), 4.0)]
    fused_cuda.increment_device_steps(steps)
    fused_cuda.increment_device_steps(steps, torch.ones(1))  # a skipped step does not count
    assert [s.item() for s in steps] == [1.0, 5.0]
    fused_cuda.increment_device_steps(steps)
    fused_cuda.rollback_skipped_steps(steps, torch.ones(1))
    assert [s.item() for s in steps] == [1.0, 5.0]
