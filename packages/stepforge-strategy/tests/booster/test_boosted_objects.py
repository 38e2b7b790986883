# SPDX-License-Identifier: Apache-2.0
"""The boosted objects as ColossalAI's code touches them, from ColossalAI's
``tests/test_booster/test_plugin/test_torch_ddp_plugin.py`` and ``colossalai/interface``:

- the model is a ``ModelWrapper``: ``.module`` is what the plugin made (DDP under ``torch_ddp``), ``.unwrap()``
  the user's model; its own ``state_dict`` keys carry ``module.`` as ColossalAI's;
- the optimizer is an ``OptimizerWrapper`` with ``backward``, ``clip_grad_by_norm``, ``clip_grad_by_value``,
  ``get_grad_norm``, ``parameters``, ``unwrap`` and ``unwrap_model``; values below are worked by hand;
- the DDP plugin converts BatchNorm to ``SyncBatchNorm`` on an accelerator (not on CPU, where torch refuses it);
- ``Accelerator`` and ``FP16TorchMixedPrecision.configure(model, optimizer, criterion)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stepforge.strategy import (
    Accelerator,
    Booster,
    FP16TorchMixedPrecision,
    ModelWrapper,
    OptimizerWrapper,
    SinglePlugin,
)
from stepforge.strategy.plugins.torch_ddp import sync_batchnorm
from stepforge.testing.distributed import requires_gloo, run_distributed


def _linear(weight: list[list[float]]) -> nn.Linear:
    layer = nn.Linear(len(weight[0]), len(weight), bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
    return layer


def _boosted(mixed_precision=None, lr=0.1):
    model = _linear([[1.0, 2.0]])
    booster = Booster(mixed_precision=mixed_precision, plugin="single")
    boosted, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=lr))
    return model, boosted, opt


def test_the_boosted_model_is_a_model_wrapper():
    model, boosted, opt = _boosted()
    assert isinstance(boosted, ModelWrapper) and boosted.module is model and boosted.unwrap() is model
    x = torch.tensor([[3.0, 4.0]])
    assert boosted(x).item() == 11.0  # 1*3 + 2*4, the forward is the module's
    assert list(boosted.state_dict()) == ["module.weight"]  # ColossalAI's keys on the wrapper itself
    assert list(boosted.unwrap().state_dict()) == ["weight"]
    assert opt.unwrap_model() is boosted and opt.parameters == [model.weight]


def test_grad_norm_and_value_clipping_by_hand():
    model, boosted, opt = _boosted()
    loss = boosted(torch.tensor([[3.0, 4.0]])).sum()
    opt.backward(loss)  # grad = x = [3, 4]
    assert opt.get_grad_norm() == pytest.approx(5.0)
    assert opt.get_grad_norm(norm_type=float("inf")) == pytest.approx(4.0)
    opt.clip_grad_by_value(3.5)
    assert model.weight.grad.tolist() == [[3.0, 3.5]]
    norm = opt.clip_grad_by_norm(1.0)  # norm of [3, 3.5] before clipping
    assert norm.item() == pytest.approx(math.hypot(3.0, 3.5))
    assert model.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert opt.get_grad_norm() == pytest.approx(math.hypot(3.0, 3.5))  # the norm clipping measured
    opt.step()
    opt.zero_grad()
    assert opt.get_grad_norm() is None  # no gradients


@pytest.mark.filterwarnings("ignore::stepforge.core.precision.SlowConfigurationWarning")
def test_fp16_grad_norm_is_unscaled_before_and_after_step():
    fp16 = FP16TorchMixedPrecision(init_scale=2.0**4)
    model, boosted, opt = _boosted(mixed_precision=fp16)
    opt.backward(boosted(torch.tensor([[3.0, 4.0]])).float().sum())
    assert model.weight.grad.tolist() == [[48.0, 64.0]]  # scaled by 16
    assert opt.get_grad_norm() == pytest.approx(5.0, rel=1e-3)  # fp16 forward: x rounds exactly
    opt.step()  # unscales to [3, 4], SGD lr 0.1
    assert model.weight[0].tolist() == pytest.approx([1.0 - 0.3, 2.0 - 0.4], rel=1e-3)
    assert opt.get_grad_norm() == pytest.approx(5.0, rel=1e-3)  # not divided a second time


def test_clip_grad_by_norm_error_if_nonfinite():
    _, boosted, opt = _boosted()
    opt.backward(boosted(torch.tensor([[float("inf"), 1.0]])).sum())
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        opt.clip_grad_by_norm(1.0, error_if_nonfinite=True)


def test_unwrap_model_without_a_model_names_the_fix():
    with pytest.raises(RuntimeError, match="bind_model"):
        OptimizerWrapper(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1)).unwrap_model()


def test_sync_batchnorm_on_an_accelerator_keeps_the_parameters():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    weight = net[1].weight
    assert sync_batchnorm(net, torch.device("cpu")) is net and type(net[1]) is nn.BatchNorm1d
    converted = sync_batchnorm(net, torch.device("cuda"))  # conversion only; no tensor moves
    assert type(converted[1]) is nn.SyncBatchNorm and converted[1].weight is weight


def _ddp_objects(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    booster = Booster(plugin="torch_ddp")
    boosted, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.25]]) * (rank + 1)
    opt.backward(boosted(x).pow(2).sum())
    return {
        "module": type(boosted.module).__name__,
        "unwrap_is_model": boosted.unwrap() is model,
        "bn": type(boosted.unwrap()[1]).__name__,
        "norm": opt.get_grad_norm(),
        "grad": [p.grad.clone() for p in model.parameters()],
    }


@requires_gloo
def test_ddp_model_wrapper_and_equal_grad_norms_on_every_rank():
    out = run_distributed(_ddp_objects, 2, timeout=120)
    for rank_out in out:
        assert rank_out["module"] == "DistributedDataParallel" and rank_out["unwrap_is_model"]
        assert rank_out["bn"] == "BatchNorm1d"  # CPU: torch's SyncBatchNorm refuses CPU inputs
    assert out[0]["norm"] == out[1]["norm"] > 0  # averaged gradients, one norm
    for a, b in zip(out[0]["grad"], out[1]["grad"], strict=True):
        assert torch.equal(a, b)


class _PlacedByBooster(SinglePlugin):
    """A plugin that leaves placing the model to the Booster (ColossalAI's ``control_device() is False``)."""

    def control_device(self) -> bool:
        return False


def test_accelerator():
    assert Booster(plugin="single").accelerator is None  # the plugin places the model
    booster = Booster(plugin=_PlacedByBooster(), device="cpu")
    assert isinstance(booster.accelerator, Accelerator) and booster.accelerator.device == torch.device("cpu")
    model = _linear([[1.0, 2.0]]).double()
    assert booster.accelerator.configure_model(model) is model
    with pytest.raises(ValueError, match="device 'meta' is not supported"):
        Accelerator("meta")


def test_fp16_torch_mixed_precision_configure():
    model = _linear([[1.0, 2.0]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.MSELoss()
    wrapped, wrapped_opt, crit = FP16TorchMixedPrecision(init_scale=2.0**5).configure(model, opt, criterion)
    assert isinstance(wrapped, ModelWrapper) and wrapped.unwrap() is model
    assert isinstance(wrapped_opt, OptimizerWrapper) and wrapped_opt.unwrap() is opt and crit is criterion
    assert wrapped_opt.loss_scale == 32.0
    assert wrapped(torch.ones(1, 2)).dtype == torch.float16  # the forward runs under fp16 autocast
    # ColossalAI's test_fp16_torch sequence: backward, clip_grad_by_norm, step
    wrapped_opt.backward(crit(wrapped(torch.tensor([[3.0, 4.0]])).float(), torch.zeros(1, 1)))
    assert model.weight.grad.tolist() == [[32 * 2 * 11 * 3.0, 32 * 2 * 11 * 4.0]]  # d(out^2)/dw, scaled by 32
    assert wrapped_opt.clip_grad_by_norm(1.0).item() == pytest.approx(2 * 11 * 5.0, rel=1e-3)
    wrapped_opt.step()  # the unit-norm gradient [0.6, 0.8] times lr 0.1
    assert model.weight[0].tolist() == pytest.approx([1.0 - 0.06, 2.0 - 0.08], rel=1e-3)
    assert FP16TorchMixedPrecision().configure(model)[1] is None
