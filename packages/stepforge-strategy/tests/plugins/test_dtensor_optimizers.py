# SPDX-License-Identifier: Apache-2.0
"""Every stepforge optimizer steps FSDP2 DTensor parameters like plain tensors.

One spawn (2 gloo processes) trains the model sharded by ``torch_fsdp`` with each optimizer, built on the
sharded parameters through the registry; the parent runs the same optimizer on plain tensors on the
concatenated batch. Tolerance: rtol 1e-4, atol 1e-5 on parameters after 3 steps (only the gradient reduction
order differs). A failure on a rank is recorded per optimizer, so each case reports its own error.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from _cases import MICRO, boosted_steps, full_params, make_model, reference_run

from stepforge.core import OPTIMIZERS, build_optimizer
from stepforge.strategy import Booster, ColossalAIOptimWrapper
from stepforge.testing.distributed import requires_gloo, run_distributed

STEPS = 3
CONFIGS = {
    "AdamW": dict(lr=1e-2, weight_decay=0.01),
    "Lamb": dict(lr=1e-2, weight_decay=0.01),
    "Lars": dict(lr=0.1, momentum=0.9, weight_decay=1e-3),
    "FusedAdam": dict(lr=1e-2, weight_decay=0.01),
    "CPUAdam": dict(lr=1e-2, weight_decay=0.01),
    "HybridAdam": dict(lr=1e-2, weight_decay=0.01),
    "FusedLAMB": dict(lr=1e-2, weight_decay=0.01),
    "FusedSGD": dict(lr=0.1, momentum=0.9),
}


def _available(name: str) -> bool:
    try:
        OPTIMIZERS.get(name)
    except Exception:
        return False
    return True


def _run_all(rank: int, world: int) -> dict:
    out = {}
    for name, cfg in CONFIGS.items():
        if not _available(name):
            continue
        try:
            booster = Booster(plugin="torch_fsdp")
            model, opt, *_ = booster.boost(make_model(), dict(type=name, **cfg))
            assert all(hasattr(p, "device_mesh") for p in model.parameters())
            wrapper = ColossalAIOptimWrapper(opt, booster=booster)
            boosted_steps(model, wrapper, STEPS, rank, world, 1)
            out[name] = full_params(booster, model)
        except Exception:  # reported per optimizer by the test below
            out[name] = traceback.format_exc()
    if _available("HybridAdam"):  # gemini's default optimizer for CPU-offloaded shards
        try:
            booster = Booster(plugin=dict(type="gemini", precision="fp32", placement_policy="auto"))
            model, opt, *_ = booster.boost(make_model(), dict(CONFIGS["HybridAdam"]))
            assert type(opt.unwrap()).__name__ == "HybridAdam"
            assert all(p.device.type == "cpu" for p in model.parameters())
            boosted_steps(model, ColossalAIOptimWrapper(opt, booster=booster), STEPS, rank, world, 1)
            out["gemini-default"] = full_params(booster, model)
        except Exception:
            out["gemini-default"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def sharded_results():
    return run_distributed(_run_all, 2, timeout=240)[0]


@requires_gloo
@pytest.mark.parametrize("name", [*CONFIGS, "gemini-default"])
def test_optimizer_on_dtensor_params_equals_plain(sharded_results, name):
    case = name
    if name == "gemini-default":  # gemini + CPU offload, optimizer config without a type: HybridAdam
        name = "HybridAdam"
    if not _available(name):
        pytest.skip(f"{name} is not installed in this venv (pip install stepforge-fused)")
    got = sharded_results[case]
    assert not isinstance(got, str), f"{name} failed on FSDP2 DTensor parameters:\n{got}"
    model = make_model()
    opt = build_optimizer(dict(type=name, **CONFIGS[name]), model.parameters())
    ref, _ = reference_run(STEPS, rows=2 * MICRO, model=model, optimizer=opt)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
