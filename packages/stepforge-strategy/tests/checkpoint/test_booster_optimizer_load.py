# SPDX-License-Identifier: Apache-2.0
"""``Booster.load_optimizer`` restores every saved state entry or fails and changes nothing.

torch's ``Optimizer.load_state_dict`` creates the state entries a fresh optimizer lacks; a DCP load fills only
the entries of its template, so a plain ``SGD(lr=...)`` (no momentum buffers) loading a ``SGD(momentum=0.5)``
save used to come back with ``momentum=0.5`` in its groups and an empty ``state``. Expected values come from the
saving optimizer itself (its buffers, its next step), never from the code under test. Bitwise: the same
arithmetic on the same values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.strategy import Booster
from stepforge.testing.distributed import requires_gloo, run_distributed


def _model(layers: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])


def _step(model: nn.Module, optimizer, rank: int) -> None:
    optimizer.zero_grad()
    optimizer.backward(model(torch.arange(8.0).reshape(2, 4) / 7 + rank).square().mean())
    optimizer.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _momentum_buffers(optimizer) -> list[torch.Tensor]:
    return [optimizer.state[p]["momentum_buffer"].detach().clone() for g in optimizer.param_groups
            for p in g["params"]]  # fmt: skip


def _save_then_load_into_plain_sgd(rank: int, world: int, plugin: str, ckpt: str) -> dict:
    booster = Booster(plugin=plugin)
    model = _model()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    _step(model, opt, rank)
    booster.save_optimizer(opt, ckpt)
    at_save, saved = _params(model), _momentum_buffers(opt)
    _step(model, opt, rank)
    expected = _params(model)

    booster2 = Booster(plugin=plugin)
    fresh = _model()
    model2, opt2, *_ = booster2.boost(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    with torch.no_grad():  # the weights the saver had at the save
        for p, q in zip(model2.parameters(), at_save, strict=True):
            p.copy_(q)
    booster2.load_optimizer(opt2, ckpt)
    loaded = _momentum_buffers(opt2)
    _step(model2, opt2, rank)
    return {
        "momentum": [g["momentum"] for g in opt2.param_groups],
        "buffers_equal": all(torch.equal(a, b) for a, b in zip(loaded, saved, strict=True)),
        "next_step_equal": all(torch.equal(p, q) for p, q in zip(_params(model2), expected, strict=True)),
    }


def test_load_optimizer_creates_the_state_a_fresh_optimizer_lacks(tmp_path):
    out = _save_then_load_into_plain_sgd(0, 1, "single", str(tmp_path / "optim"))
    assert out == {"momentum": [0.5], "buffers_equal": True, "next_step_equal": True}


@requires_gloo
def test_load_optimizer_creates_missing_state_under_torch_ddp(tmp_path):
    per_rank = run_distributed(
        _save_then_load_into_plain_sgd, 2, "torch_ddp", str(tmp_path / "optim"), timeout=120
    )
    for out in per_rank:
        assert out == {"momentum": [0.5], "buffers_equal": True, "next_step_equal": True}


def test_load_optimizer_of_another_model_fails_and_changes_nothing(tmp_path):
    booster = Booster(plugin="single")
    bigger = _model(layers=3)
    bigger, opt, *_ = booster.boost(bigger, torch.optim.AdamW(bigger.parameters(), lr=0.1))
    _step(bigger, opt, 0)
    booster.save_optimizer(opt, tmp_path / "optim")

    booster2 = Booster(plugin="single")
    model = _model(layers=2)
    model, opt2, *_ = booster2.boost(model, torch.optim.AdamW(model.parameters(), lr=0.3))
    _step(model, opt2, 0)
    _step(model, opt2, 0)
    before = {i: {k: v.clone() for k, v in opt2.state[p].items()} for i, p in enumerate(model.parameters())}
    with pytest.raises(ValueError, match=r"load_optimizer: .*2\.weight"):
        booster2.load_optimizer(opt2, tmp_path / "optim")
    assert opt2.param_groups[0]["lr"] == 0.3
    for i, p in enumerate(model.parameters()):
        assert set(opt2.state[p]) == set(before[i])
        assert all(torch.equal(opt2.state[p][k], v) for k, v in before[i].items())
