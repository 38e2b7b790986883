# SPDX-License-Identifier: Apache-2.0
"""DynamicLossScaler: the update rule written out, GradScaler parity, argument checks, state-dict formats."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from stepforge.core import HyperParameterError
from stepforge.core.precision import STATE_KEYS, DynamicLossScaler, validate_loss_scaler_args

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "loss_scaler"
GRADSCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}


def _counters(s: DynamicLossScaler) -> tuple[float, int, int]:
    state = s.state_dict()
    return state["scale"], state["_growth_tracker"], state["_hysteresis_left"]


def test_growth_backoff_and_hysteresis_follow_colossalai_written_out():
    s = DynamicLossScaler(
        initial_scale=16, growth_factor=2, backoff_factor=0.5, growth_interval=2, min_scale=2, max_scale=64,
        hysteresis=2,
    )  # fmt: skip
    # (overflow, expected (scale, clean steps since growth/overflow, overflows left before a back-off))
    script = [
        (True, (16.0, 0, 1)),  # the first overflow only spends the budget
        (True, (8.0, 0, 0)),  # budget spent: back off
        (True, (4.0, 0, 0)),  # and every further overflow backs off until a growth
        (False, (4.0, 1, 0)),
        (False, (8.0, 0, 2)),  # growth_interval clean steps: grow, refill the budget
        (True, (8.0, 0, 1)),
        (False, (8.0, 1, 1)),  # a clean step alone does not refill the budget
        (True, (4.0, 0, 0)),
        (True, (2.0, 0, 0)),
        (True, (2.0, 0, 0)),  # never below min_scale
        (False, (2.0, 1, 0)),
        (False, (4.0, 0, 2)),
    ]
    for i, (overflow, expected) in enumerate(script):
        s.update(overflow)
        assert _counters(s) == expected, i
    for expected_scale in (8.0, 16.0, 32.0, 64.0, 64.0):  # never above max_scale
        s.update(False)
        s.update(False)
        assert s.get_scale() == expected_scale


def test_update_without_argument_uses_the_unscale_verdict():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    s = DynamicLossScaler(initial_scale=8.0)
    p.grad = torch.tensor([8.0, -16.0, 4.0])
    assert s.unscale_(opt) is False
    assert torch.equal(p.grad, torch.tensor([1.0, -2.0, 0.5]))
    p.grad = torch.tensor([1.0, math.nan, 0.0])
    assert s.unscale_(opt) is True and s.found_inf
    s.update()
    assert s.get_scale() == 4.0 and s.found_inf is False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_torch_grad_scaler_step_by_step(seed):
    gen = torch.Generator().manual_seed(seed)
    flags = (torch.rand(40, generator=gen) < 0.3).tolist()
    ours = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    params = {k: torch.nn.Parameter(torch.zeros(4)) for k in ("ours", "theirs")}
    opts = {k: torch.optim.SGD([p], lr=0.0) for k, p in params.items()}
    for step, bad in enumerate(flags):
        for name, scaler in (("ours", ours), ("theirs", theirs)):
            loss = scaler.scale(params[name].sum() + 1.0)  # GradScaler creates its scale lazily here
            loss.backward()
            if bad:
                params[name].grad[1] = math.inf
            scaler.unscale_(opts[name])
            if scaler is theirs:
                scaler.step(opts[name])
            scaler.update()
            opts[name].zero_grad()
        mine, torch_state = ours.state_dict(), theirs.state_dict()
        assert set(torch_state) == GRADSCALER_KEYS
        assert {k: mine[k] for k in GRADSCALER_KEYS} == torch_state, step
    # each loads the other's state dict
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(ours.state_dict())
    assert fresh.state_dict() == theirs.state_dict()
    back = DynamicLossScaler()
    back.load_state_dict(theirs.state_dict())
    assert {k: back.state_dict()[k] for k in GRADSCALER_KEYS} == theirs.state_dict()


def test_arguments_are_checked_in_one_place_with_the_parameter_named():
    cases = [
        (dict(initial_scale=0.0), "initial_scale must lie in"),
        (dict(initial_scale=2.0, min_scale=4.0), r"initial_scale must lie in \[min_scale, max_scale\]"),
        (dict(min_scale=0.0, initial_scale=1.0), "min_scale must be > 0"),
        (dict(max_scale=0.5), "max_scale must be >= min_scale"),
        (dict(growth_factor=1.0), "growth_factor must be > 1"),
        (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
        (dict(growth_interval=0), "growth_interval must be an int >= 1"),
        (dict(growth_interval=2.0), "growth_interval must be an int >= 1"),
        (dict(hysteresis=True), "hysteresis must be an int >= 1"),
        (dict(growth_factor=math.inf), "growth_factor must be a finite number"),
        (dict(initial_scale="big"), "initial_scale must be a finite number"),
        (dict(initial_scale=4.0, init_scale=8.0), "initial_scale and init_scale are the same argument"),
        (
            dict(init_scale=0.5),
            r"init_scale must lie in \[min_scale, max_scale\] = \[1, 4.29497e\+09\]",
        ),  # as passed
    ]
    for kwargs, message in cases:
        with pytest.raises(HyperParameterError, match=message) as info:
            DynamicLossScaler(**kwargs)
        assert str(info.value).startswith("DynamicLossScaler: ")
        assert isinstance(info.value, ValueError)
    with pytest.raises(HyperParameterError, match="^GeminiPlugin: hysteresis"):
        validate_loss_scaler_args("GeminiPlugin", hysteresis=0)


def test_both_spellings_and_the_defaults():
    assert DynamicLossScaler(init_scale=32.0).get_scale() == DynamicLossScaler(32.0).get_scale() == 32.0
    assert DynamicLossScaler(initial_scale=32.0).get_scale() == 32.0
    default = DynamicLossScaler().state_dict()
    # GradScaler's defaults (and ColossalAI's bounds); hysteresis 1 is GradScaler's back-off on every overflow
    assert default == {
        "scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
        "_growth_tracker": 0, "min_scale": 1.0, "max_scale": 2.0**32, "hysteresis": 1, "_hysteresis_left": 1,
    }  # fmt: skip
    assert tuple(default) == STATE_KEYS


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_loads_the_strategy_scaler_format_of_main_6f11751():
    fx = _fixture("strategy_scaler.json")
    assert fx["commit"] == "6f11751"
    s = DynamicLossScaler()
    s.load_state_dict(fx["state_dict"])
    assert s.state_dict() == fx["state_dict"]  # same keys, same values
    s.update(True)  # one overflow was left in the budget (1): back off 1024 * 0.25
    assert _counters(s) == (256.0, 0, 0)
    # replaying the recorded run: the old scaler refilled its budget on any clean step, the new one on a growth
    # only (ColossalAI), so the last overflow (after a back-off and one clean step) now backs off
    replay = DynamicLossScaler(**fx["args"])
    scales = []
    for flag in fx["flags"]:
        replay.update(flag)
        scales.append(replay.get_scale())
    assert scales[:9] == fx["scales"][:9] == [1024.0] * 5 + [4096.0, 4096.0, 1024.0, 1024.0]
    assert (fx["scales"][9], scales[9]) == (1024.0, 256.0)


def test_loads_the_zero_scaler_format_of_main_6f11751():
    fx = _fixture("zero_scaler.json")
    s = DynamicLossScaler()
    s.load_state_dict(fx["state_dict"])
    old = fx["state_dict"]
    assert s.state_dict() == {
        "scale": old["scale"], "growth_factor": old["growth_factor"], "backoff_factor": old["backoff_factor"],
        "growth_interval": old["growth_interval"], "_growth_tracker": old["growth_tracker"],
        "min_scale": old["min_scale"], "max_scale": old["max_scale"], "hysteresis": old["hysteresis"],
        "_hysteresis_left": old["hysteresis_left"],
    }  # fmt: skip
    assert _counters(s) == (2304.0, 0, 3)
    replay = DynamicLossScaler(**fx["args"])  # zero's spelling initial_scale
    scales = []
    for flag in fx["flags"]:
        replay.update(flag)
        scales.append(replay.get_scale())
    assert scales == fx["scales"]  # this run never differs between the two hysteresis rules


def test_loads_the_loss_scaler_inside_a_zero_fp16_state_dict_of_main_6f11751():
    full = torch.load(FIXTURES / "zero_optimizer_fp16.pt", weights_only=True)
    s = DynamicLossScaler()
    s.load_state_dict(full["zero"]["loss_scaler"])
    assert _counters(s) == (64.0, 1, 1)
    assert (s.min_scale, s.max_scale, s.growth_factor, s.backoff_factor) == (2.0, 4096.0, 4.0, 0.25)
    s.update(False)  # growth_interval 2: the second clean step grows
    assert _counters(s) == (256.0, 0, 2)
    with pytest.raises(HyperParameterError, match="unexpected key 'loss_scaler'"):
        DynamicLossScaler().load_state_dict(full["zero"])


def test_a_foreign_state_is_rejected_naming_the_key_and_changes_nothing():
    s = DynamicLossScaler(initial_scale=8.0)
    before = s.state_dict()
    opt_state = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).state_dict()
    bad = [
        (opt_state, "unexpected key 'param_groups'"),
        ({"scale": 4.0, "loss_scale": 2.0}, "unexpected key 'loss_scale'"),
        ({}, "has no 'scale' key"),
        ({"growth_factor": 2.0}, "has no 'scale' key"),
        (
            {"scale": 4.0, "growth_tracker": 1, "_growth_tracker": 1},
            "both 'growth_tracker' and '_growth_tracker'",
        ),
        ({"scale": -1.0}, "'scale' must be a finite number > 0"),
        ({"scale": 4.0, "hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"scale": 4.0, "_growth_tracker": -1}, "'_growth_tracker' must be an int >= 0"),
        ([("scale", 4.0)], "expected a dict"),
    ]
    for state, message in bad:
        with pytest.raises(HyperParameterError, match=message):
            s.load_state_dict(state)
        assert s.state_dict() == before


def test_a_tensor_scale_loads_and_the_scale_may_lie_outside_the_bounds():
    s = DynamicLossScaler(min_scale=1.0)
    s.load_state_dict({"scale": torch.tensor(0.5), "growth_factor": 2.0, "_growth_tracker": torch.tensor(3)})
    assert _counters(s) == (0.5, 3, 1)
    assert isinstance(s.state_dict()["scale"], float)


def test_dtensor_free_unscale_of_explicit_gradients():
    s = DynamicLossScaler(initial_scale=4.0)
    grads = [torch.full((2,), 8.0), torch.empty(0), torch.full((3,), -4.0, dtype=torch.float16)]
    assert s.unscale_grads_(grads) is False
    assert torch.equal(grads[0], torch.full((2,), 2.0))
    assert torch.equal(grads[2], torch.full((3,), -1.0, dtype=torch.float16))
    assert s.unscale_grads_([torch.tensor([1.0]), torch.tensor([-math.inf], dtype=torch.bfloat16)]) is True
