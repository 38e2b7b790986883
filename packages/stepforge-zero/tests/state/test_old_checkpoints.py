# SPDX-License-Identifier: Apache-2.0
"""Checkpoints written by stepforge-zero before ``stepforge.core.precision`` (main at 6f11751, when zero had its
own loss scaler) still load, and continue as the old optimizer would have.

Fixtures (written by ``tools/make_scaler_fixtures.py`` on that commit):
- ``stepforge-core/tests/fixtures/loss_scaler/zero_optimizer_fp16.pt``: ``LowLevelZeroOptimizer.state_dict()`` of
  an fp16 ``Linear(4, 3)`` under SGD(lr 0.5, momentum 0.9) after 6 steps, 3 of them skipped for overflow;
- ``stepforge-strategy/tests/fixtures/booster_zero2_fp16_optimizer/``: ``Booster(plugin=zero2 fp16)
  .save_optimizer`` (DCP), with ``booster_fixtures.json`` recording the scaler state it holds.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stepforge.core.flat_shard import FlatShard
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.zero import LowLevelZeroOptimizer, LowLevelZeroPlugin

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])
FULL = ROOT / "packages/stepforge-core/tests/fixtures/loss_scaler/zero_optimizer_fp16.pt"
BOOSTER = ROOT / "packages/stepforge-strategy/tests/fixtures"


def _fixture_optimizer() -> tuple[torch.nn.Module, LowLevelZeroOptimizer]:
    # the arguments the fixture was written with
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.float16)
    opt = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        stage=2,
        initial_scale=256.0,
        growth_interval=2,
        hysteresis=2,
        min_scale=2.0,
        max_scale=2.0**12,
        growth_factor=4.0,
        backoff_factor=0.25,
    )
    return model, opt


def test_full_state_dict_of_the_old_scaler_loads_and_continues():
    saved = torch.load(FULL, weights_only=True)
    old_scaler = saved["zero"]["loss_scaler"]
    assert "growth_tracker" in old_scaler and "_growth_tracker" not in old_scaler  # the old format
    model, opt = _fixture_optimizer()
    opt.load_state_dict(saved)
    assert opt.skipped_steps == 3
    assert opt.loss_scale == old_scaler["scale"] == 64.0
    # the saved layout is kept: state_dict() gives back what was loaded, key for key
    again = opt.state_dict()
    assert again["zero"]["loss_scaler"] == old_scaler
    for index, entry in saved["state"].items():
        assert torch.equal(again["state"][index]["momentum_buffer"], entry["momentum_buffer"])
    for index, master in saved["zero"]["master_weights"].items():
        assert torch.equal(again["zero"]["master_weights"][index], master)

    # one clean step, written out: loss = sum of the outputs for 2 rows of ones, so d/dW = 2, d/db = 2
    opt.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum())
    opt.step()
    assert not opt.last_step_skipped
    for index, param in enumerate(model.parameters()):
        buf = 0.9 * saved["state"][index]["momentum_buffer"] + 2.0
        want = saved["zero"]["master_weights"][index] - 0.5 * buf
        assert torch.equal(param.detach(), want.to(torch.float16)), index
    # growth_tracker 1 + this clean step reaches growth_interval 2: the scale grows by 4 and the budget refills
    state = opt.scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"], state["_hysteresis_left"]) == (256.0, 0, 2)


def _load_booster_dir(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    plugin = LowLevelZeroPlugin(
        stage=2,
        precision="fp16",
        initial_scale=1024.0,
        growth_interval=2,
        hysteresis=2,
        min_scale=8.0,
        max_scale=2.0**14,
    )
    model = torch.nn.Linear(4, 3)
    model, opt = plugin.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    model_sd, _ = plugin.get_state_dict(model, opt)
    # the index-keyed layout of that version: the pieces by index, seen flat (stepforge.strategy's loads build
    # this template when the checkpoint's groups list indices)
    optim_sd = opt.sharded_state_dict()
    optim_sd["state"] = {
        i: {k: v.flat() if isinstance(v, FlatShard) else v for k, v in e.items()}
        for i, e in optim_sd["state"].items()
    }
    masters = optim_sd["zero"]["master_weights"]
    optim_sd["zero"]["master_weights"] = {i: v.flat() for i, v in masters.items()}
    optim_sd["param_groups"] = [
        {**g, "params": [int(i) for i in g["params"]]} for g in optim_sd["param_groups"]
    ]
    state = {"optimizer": optim_sd}
    dcp.load(state, checkpoint_id=directory)  # the template's keys must all be in the old directory
    plugin.set_state_dict(model, opt, model_sd, state["optimizer"])
    return {
        "scaler": opt.scaler.state_dict(),
        "skipped": opt.skipped_steps,
        "momentum": [opt.unwrap().state[s.master]["momentum_buffer"].clone() for s in opt.layout.slots],
    }


@pytest.mark.distributed
@requires_gloo
def test_booster_zero2_directory_of_the_old_scaler_loads():
    recorded = json.loads((BOOSTER / "booster_fixtures.json").read_text())["booster_zero2_fp16_optimizer"]
    old = recorded["loss_scaler"]
    got = run_distributed(_load_booster_dir, 1, str(BOOSTER / "booster_zero2_fp16_optimizer"), timeout=120)[0]
    renamed = {"growth_tracker": "_growth_tracker", "hysteresis_left": "_hysteresis_left"}
    assert got["scaler"] == {renamed.get(k, k): v for k, v in old.items()}
    assert got["skipped"] == 2  # (True, False, True, False, False): two overflows
    # three clean steps of SGD with momentum: the buffers hold real state, not the template's zeros
    assert all(bool(m.abs().min() > 0) for m in got["momentum"])
