# SPDX-License-Identifier: Apache-2.0
"""The Booster's loads verify, then apply: a file of another model, optimizer or scheduler, or a damaged data
file, raises ``CheckpointError`` and leaves the model, the optimizer (state and lr) and the scheduler as they
were, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from _strategy_cases import make_model
from torch import nn

from stepforge.core import unwrap_optimizer
from stepforge.strategy import Booster, CheckpointError


def _boosted(seed: int, optimizer: str = "AdamW", width: int = 16) -> tuple:
    torch.manual_seed(seed)
    net = (
        make_model(seed)
        if width == 16
        else nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))
    )
    opt = (
        torch.optim.AdamW(net.parameters(), lr=0.1)
        if optimizer == "AdamW"
        else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    booster = Booster(plugin="single")
    model, opt, _, _, sched = booster.boost(net, opt, lr_scheduler=sched)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return booster, model, opt, sched


def _snapshot(model, opt, sched) -> list:
    inner = unwrap_optimizer(opt)
    out = [t.detach().clone() for t in model.state_dict().values()]
    out += [v.clone() for s in inner.state.values() for v in s.values()]
    out += [torch.tensor(g["lr"]) for g in inner.param_groups]
    out += [torch.tensor(float(v)) for v in sched.state_dict().values() if isinstance(v, int | float)]
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_booster_loads_of_other_objects_change_nothing(tmp_path):
    booster, model, opt, sched = _boosted(0)
    booster.save_model(model, tmp_path / "model.safetensors")
    booster.save_optimizer(opt, tmp_path / "optim", shard=True)
    booster.save_lr_scheduler(sched, tmp_path / "sched.pt")
    other, model2, opt2, _ = _boosted(1, width=32)
    before = _snapshot(model2, opt2, torch.optim.lr_scheduler.StepLR(unwrap_optimizer(opt2), 2))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        other.load_model(model2, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="load_optimizer"):
        other.load_optimizer(opt2, tmp_path / "optim")
    after = _snapshot(model2, opt2, torch.optim.lr_scheduler.StepLR(unwrap_optimizer(opt2), 2))
    assert _same(before, after)

    sgd_booster, sgd_model, sgd, sgd_sched = _boosted(2, optimizer="SGD")
    before = _snapshot(sgd_model, sgd, sgd_sched)
    with pytest.raises(CheckpointError, match="another optimizer type"):
        sgd_booster.load_optimizer(sgd, tmp_path / "optim")
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(unwrap_optimizer(sgd), T_max=5)
    cosine_before = dict(cosine.state_dict())
    with pytest.raises(CheckpointError, match="another scheduler type"):
        sgd_booster.load_lr_scheduler(cosine, tmp_path / "sched.pt")
    assert cosine.state_dict() == cosine_before
    assert _same(before, _snapshot(sgd_model, sgd, sgd_sched))


def test_booster_load_optimizer_of_a_damaged_file_changes_nothing(tmp_path):
    booster, _, opt, _ = _boosted(0)
    booster.save_optimizer(opt, tmp_path / "optim", shard=True)
    data = next(n for n in os.listdir(tmp_path / "optim") if n.endswith(".distcp"))
    path = tmp_path / "optim" / data
    os.truncate(path, os.path.getsize(path) // 2)
    other, model2, opt2, sched2 = _boosted(1)
    before = _snapshot(model2, opt2, sched2)
    with pytest.raises(CheckpointError):
        other.load_optimizer(opt2, tmp_path / "optim")
    assert _same(before, _snapshot(model2, opt2, sched2))
