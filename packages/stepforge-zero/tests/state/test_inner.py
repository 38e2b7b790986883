# SPDX-License-Identifier: Apache-2.0
"""CPU offload: which inner optimizer steps the CPU pieces, and the error for one that cannot (one process).

The numerical parity of offloaded training with the single-process run is in test_low_level_parity.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stepforge.core import OPTIMIZERS, HyperParameterError
from stepforge.testing.zero_cases import make_model, param_groups
from stepforge.zero.low_level import LowLevelZeroOptimizer


def test_adam_family_config_becomes_cpu_adam_with_offload():
    if "CPUAdam" not in OPTIMIZERS:  # pragma: no cover - stepforge-fused is a test dependency
        pytest.fail("stepforge-fused (CPUAdam) must be installed for the zero tests")
    cpu_adam = OPTIMIZERS.get("CPUAdam")
    for name, adamw_mode in (("AdamW", True), ("Adam", False), ("FusedAdam", True)):
        model = make_model()
        cfg = dict(type=name, lr=0.01, weight_decay=0.01, betas=(0.8, 0.9))
        opt = LowLevelZeroOptimizer(cfg, params=param_groups(model), cpu_offload=True)
        assert type(opt.optim) is cpu_adam
        group = opt.optim.param_groups[0]
        assert group["adamw_mode"] is adamw_mode and group["betas"] == (0.8, 0.9) and group["lr"] == 0.01
        assert all(s.master.device.type == "cpu" for s in opt.layout.slots)
    # without offload, and for a torch-only option, the config is built as given
    model = make_model()
    opt = LowLevelZeroOptimizer(dict(type="AdamW", lr=0.01), params=model.parameters())
    assert type(opt.optim) is torch.optim.AdamW
    opt = LowLevelZeroOptimizer(
        dict(type="AdamW", lr=0.01, amsgrad=True), params=model.parameters(), cpu_offload=True
    )
    assert type(opt.optim) is torch.optim.AdamW


class _AcceleratorOnlySGD(torch.optim.SGD):
    """Stands in for an optimizer whose kernels exist only on an accelerator."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.device.type == "cpu":
                    raise RuntimeError("expected all tensors to be on an accelerator device")
        return super().step(closure)


def test_an_inner_optimizer_that_cannot_step_cpu_tensors_gets_a_clear_error():
    model = make_model()
    opt = LowLevelZeroOptimizer(_AcceleratorOnlySGD(model.parameters(), lr=0.1), cpu_offload=True)
    model(torch.ones(2, 7)).sum().backward()
    with pytest.raises(RuntimeError, match=r"cpu_offload=True.*_AcceleratorOnlySGD.*CPUAdam"):
        opt.step()


def test_wrapping_needs_a_fresh_inner_optimizer_and_params_only_with_a_config():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 7)).sum().backward()
    inner.step()
    with pytest.raises(HyperParameterError, match="already has state"):
        LowLevelZeroOptimizer(inner)
    with pytest.raises(HyperParameterError, match="drop params="):
        LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), params=model.parameters())
    with pytest.raises(HyperParameterError, match="torch.optim.Optimizer or a config dict"):
        LowLevelZeroOptimizer("AdamW")  # type: ignore[arg-type]
