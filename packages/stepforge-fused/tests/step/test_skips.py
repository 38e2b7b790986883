# SPDX-License-Identifier: Apache-2.0
"""``_step.device.SkipTracker``: host and device skip decisions, read back only when asked."""

from __future__ import annotations

import torch

from stepforge.fused import FusedAdam
from stepforge.fused._step.device import SkipTracker


def test_host_skips_are_counted_and_cleared_by_the_next_step():
    t = SkipTracker()
    assert not t.last_skipped() and t.skipped() == 0
    t.skip_on_host()
    t.skip_on_host()
    assert t.last_skipped() and t.skipped() == 2
    t.begin_step()
    assert not t.last_skipped() and t.skipped() == 2


def test_device_flags_count_on_the_device_and_are_read_on_access():
    t = SkipTracker()
    dev = torch.device("cpu")  # the tracker only does tensor arithmetic: a CPU tensor stands in for CUDA
    flag = t.device_flag(dev, None)
    assert flag.tolist() == [0.0] and t.device_flag(dev, None) is flag, "one persistent flag per device"
    t.record_device(dev, flag)
    assert not t.last_skipped() and t.skipped() == 0
    t.begin_step()
    flag = t.device_flag(dev, torch.tensor(1.0))  # GradScaler's found_inf copied in
    t.record_device(dev, flag)
    assert t.last_skipped() and t.skipped() == 1
    t.set_skipped(5)
    assert t.skipped() == 5 and t.counts == {}
    t.set_last(False)
    assert not t.last_skipped()


def test_the_optimizer_reports_through_its_tracker():
    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], skip_nonfinite=True)
    p.grad = torch.full((4,), float("inf"))
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1 and opt._skips.host_count == 1
    opt.skipped_steps = 0
    p.grad = torch.ones(4)
    opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 0
