# SPDX-License-Identifier: Apache-2.0
"""core.precision through the strategy: the one scaler, checkpoints of main 6f11751, the fp16-on-CPU note."""

from __future__ import annotations

import json
import math
import pathlib
import warnings

import pytest
import torch

import stepforge.core.precision as core_precision
import stepforge.strategy as strategy
from stepforge.core import PLUGINS
from stepforge.strategy import Booster
from stepforge.testing.distributed import run_distributed

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
INFO = json.loads((FIXTURES / "booster_fixtures.json").read_text())
SLOW_ON_CPU = "stepforge.core.precision.SlowConfigurationWarning"
HAVE_ZERO = "zero2" in PLUGINS


def test_one_scaler_class_re_exported():
    assert strategy.DynamicLossScaler is core_precision.DynamicLossScaler
    with pytest.raises(ModuleNotFoundError):
        __import__("stepforge.strategy.loss_scaler")


def _train(booster: Booster, model: torch.nn.Module, overflows: tuple[bool, ...]):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt, *_ = booster.boost(model, opt)
    for overflow in overflows:
        loss = model(torch.ones(2, 4)).float().sum()
        booster.backward(loss * (math.inf if overflow else 1.0), opt)
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.filterwarnings(f"ignore::{SLOW_ON_CPU}")  # fp16 on CPU is what the checkpoint holds
def test_booster_fp16_checkpoint_of_main_6f11751_loads():
    info = INFO["booster_fp16_optimizer"]
    assert INFO["commit"] == "6f11751"
    booster = Booster(mixed_precision=info["mixed_precision"], plugin="single")
    torch.manual_seed(0)
    _, opt = _train(booster, torch.nn.Linear(4, 3), ())
    assert opt.loss_scale == 2048.0
    booster.load_optimizer(opt, FIXTURES / "booster_fp16_optimizer")
    assert opt.scaler_state_dict() == info["grad_scaler"]
    assert opt.loss_scale == 1024.0
    # the SGD momentum buffers came back too (the run took three clean steps)
    assert all(opt.state[p]["momentum_buffer"].abs().sum() > 0 for p in opt.param_groups[0]["params"])
    loss = opt.param_groups[0]["params"][1].sum() * math.inf
    opt.backward(loss)
    opt.step()  # hysteresis 1: the overflow backs off at once
    assert opt.last_step_skipped and opt.loss_scale == 512.0


def _zero_checkpoint(rank: int, world_size: int, args: dict, directory: str) -> dict:
    from stepforge.zero import LowLevelZeroPlugin

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU: this is the configuration the checkpoint was saved in
        booster = Booster(plugin=LowLevelZeroPlugin(**args))
        torch.manual_seed(0)
        model, opt = _train(booster, torch.nn.Linear(4, 3), ())
    out = {"fresh": (opt.loss_scale, opt.skipped_steps)}
    booster.load_optimizer(opt, directory)
    out["loaded"] = (opt.loss_scale, opt.skipped_steps)
    scales = []
    for overflow in (True, True, False, False):  # hysteresis 2, growth_interval 2
        loss = model(torch.ones(2, 4)).float().sum()
        booster.backward(loss * (math.inf if overflow else 1.0), opt)
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    out["scales"] = scales
    return out


@pytest.mark.skipif(not HAVE_ZERO, reason="stepforge-zero is not installed (zero2 comes from it)")
def test_booster_zero2_fp16_checkpoint_of_main_6f11751_loads():
    info = INFO["booster_zero2_fp16_optimizer"]
    (out,) = run_distributed(
        _zero_checkpoint, 1, info["plugin"], str(FIXTURES / "booster_zero2_fp16_optimizer"), timeout=120
    )
    assert out["fresh"] == (1024.0, 0)
    # the run saved after overflow, clean, overflow, clean, clean: scale 1024 (budget refilled by the growth)
    assert out["loaded"] == (info["loss_scaler"]["scale"], 2) == (1024.0, 2)
    # one overflow only spends the budget, the second backs off; two clean steps grow again
    assert out["scales"] == [1024.0, 512.0, 512.0, 1024.0]


def _notes(rank: int, world_size: int) -> dict:
    from stepforge.core.precision import SlowConfigurationWarning

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mixed, plugin in (
            (None, "zero2"),
            (None, "zero2"),
            (None, dict(type="zero2", precision="bf16")),
            ("bf16", "gemini"),
            (None, dict(type="gemini", precision="fp32")),
        ):
            booster = Booster(mixed_precision=mixed, plugin=plugin)
            model = torch.nn.Linear(4, 3)
            booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    notes = [w for w in caught if issubclass(w.category, SlowConfigurationWarning)]
    out["notes"] = [(str(w.message), w.filename) for w in notes]
    out["precisions"] = [Booster(plugin="zero2").plugin.precision]
    return out


@pytest.mark.skipif(not HAVE_ZERO, reason="stepforge-zero is not installed (zero2 comes from it)")
def test_zero2_default_fp16_on_cpu_is_noted_once_at_boost():
    # a fresh process: the note is once per process
    (out,) = run_distributed(_notes, 1, timeout=120)
    assert out["precisions"] == ["fp16"]  # ColossalAI's default is kept
    (note,) = out["notes"]  # the second zero2 boost and the bf16 ones say nothing
    message, filename = note
    assert message.startswith("Booster.boost(plugin=Zero2Plugin): precision 'fp16' runs on a CPU device")
    assert "precision='bf16'" in message and "about 25x" in message
    assert filename == __file__  # points at the line that called boost
