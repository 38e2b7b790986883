# SPDX-License-Identifier: Apache-2.0
"""Write the loss-scaler compatibility fixtures from the code of main at 6f11751 (run there, once).

Before ``stepforge.core.precision`` there were two ``DynamicLossScaler`` classes with two state-dict formats:
``stepforge/strategy/loss_scaler.py`` (GradScaler keys + ``min_scale``/``max_scale``/``hysteresis``/
``_hysteresis_left``) and ``stepforge/zero/_loss_scaler.py`` (``growth_tracker``/``hysteresis_left``). This script
records what each wrote, and how users saved it, so the tests can prove that checkpoints of that code still load:

packages/stepforge-core/tests/fixtures/loss_scaler/
    strategy_scaler.json   the strategy scaler: arguments, overflow flags, scale after each, ``state_dict()``
    zero_scaler.json       the same for zero's scaler
    zero_optimizer_fp16.pt ``LowLevelZeroOptimizer(...).state_dict()`` of an fp16 model (scaler under
                           ``["zero"]["loss_scaler"]``); tensors and plain values only (``weights_only=True``)
packages/stepforge-strategy/tests/fixtures/
    booster_fp16_optimizer/ ``Booster(mixed_precision=fp16, plugin="single").save_optimizer`` (DCP directory;
                           the scaler under ``grad_scaler``)
    booster_zero2_fp16_optimizer/ ``Booster(plugin=zero2 fp16).save_optimizer`` (DCP; the scaler under
                           ``optimizer.zero.loss_scaler``)
    booster_fixtures.json  the arguments and the scaler state each directory holds

It imports the deleted modules, so it only runs on a checkout of 6f11751:
``git worktree add /tmp/sf-6f11751 6f11751`` then, with that tree's packages installed,
``python tools/make_scaler_fixtures.py <output root>``.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import torch
import torch.distributed as dist

COMMIT = "6f11751"
FLAGS = [False, False, True, False, False, False, True, True, False, True]


def _scaler_fixture(make, update, state) -> dict:
    scaler, args = make()
    scales = []
    for overflow in FLAGS:
        update(scaler, overflow)
        scales.append(state(scaler)["scale"])
    return {"commit": COMMIT, "args": args, "flags": FLAGS, "scales": scales, "state_dict": state(scaler)}


def strategy_scaler() -> dict:
    from stepforge.strategy.loss_scaler import DynamicLossScaler

    args = dict(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3, min_scale=2.0,
                max_scale=2.0**20, hysteresis=2)  # fmt: skip
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    def update(scaler, overflow):
        opt.param_groups[0]["params"][0].grad = torch.tensor([math.inf if overflow else 1.0, 0.0])
        scaler.unscale_(opt)
        scaler.update()

    return _scaler_fixture(lambda: (DynamicLossScaler(**args), args), update, lambda s: s.state_dict())


def zero_scaler() -> dict:
    from stepforge.zero._loss_scaler import DynamicLossScaler

    args = dict(initial_scale=512.0, min_scale=4.0, growth_factor=3.0, backoff_factor=0.5, growth_interval=2,
                hysteresis=3, max_scale=2.0**16)  # fmt: skip
    return _scaler_fixture(
        lambda: (DynamicLossScaler(**args), args), lambda s, o: s.update(o), lambda s: s.state_dict()
    )


def zero_optimizer() -> dict:
    from stepforge.zero import LowLevelZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.float16)
    opt = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), stage=2,
                                initial_scale=256.0, growth_interval=2, hysteresis=2, min_scale=2.0,
                                max_scale=2.0**12, growth_factor=4.0, backoff_factor=0.25)  # fmt: skip
    for overflow in (False, True, False, True, True, False):
        loss = model(torch.ones(2, 4, dtype=torch.float16)).float().sum()
        opt.backward(loss * (math.inf if overflow else 1.0))
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


def _boost_and_train(booster, model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt, *_ = booster.boost(model, opt)
    for overflow in steps:
        loss = model(torch.ones(2, 4)).float().sum()
        booster.backward(loss * (math.inf if overflow else 1.0), opt)
        opt.step()
        opt.zero_grad()
    return model, opt


def booster_checkpoints(root: pathlib.Path) -> dict:
    from stepforge.strategy import Booster
    from stepforge.zero import LowLevelZeroPlugin

    out = {"commit": COMMIT}
    torch.manual_seed(0)
    fp16_args = dict(type="fp16", init_scale=2048.0, growth_interval=2, growth_factor=2.0, backoff_factor=0.5)
    booster = Booster(mixed_precision=fp16_args, plugin="single")
    _, opt = _boost_and_train(booster, torch.nn.Linear(4, 3), (False, True, False, False, True))
    booster.save_optimizer(opt, root / "booster_fp16_optimizer")
    out["booster_fp16_optimizer"] = {"mixed_precision": fp16_args, "grad_scaler": opt.scaler_state_dict()}

    torch.manual_seed(0)
    zero_args = dict(stage=2, precision="fp16", initial_scale=1024.0, growth_interval=2, hysteresis=2,
                     min_scale=8.0, max_scale=2.0**14)  # fmt: skip
    booster = Booster(plugin=LowLevelZeroPlugin(**zero_args))
    _, zopt = _boost_and_train(booster, torch.nn.Linear(4, 3), (True, False, True, False, False))
    booster.save_optimizer(zopt, root / "booster_zero2_fp16_optimizer")
    out["booster_zero2_fp16_optimizer"] = {"plugin": zero_args, "loss_scaler": zopt.scaler.state_dict()}
    return out


def main(root: pathlib.Path) -> None:
    core = root / "packages/stepforge-core/tests/fixtures/loss_scaler"
    strategy = root / "packages/stepforge-strategy/tests/fixtures"
    core.mkdir(parents=True, exist_ok=True)
    strategy.mkdir(parents=True, exist_ok=True)
    (core / "strategy_scaler.json").write_text(json.dumps(strategy_scaler(), indent=1) + "\n")
    (core / "zero_scaler.json").write_text(json.dumps(zero_scaler(), indent=1) + "\n")
    torch.save(zero_optimizer(), core / "zero_optimizer_fp16.pt")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29731", rank=0, world_size=1)
    try:
        info = booster_checkpoints(strategy)
    finally:
        dist.destroy_process_group()
    (strategy / "booster_fixtures.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "."))
