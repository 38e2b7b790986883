# SPDX-License-Identifier: Apache-2.0
"""LoRA under ``LowLevelZeroPlugin`` (one process): adapters that the optimizer does not hold join the param group
of their layer's frozen base weight (``stepforge.zero.plugin.lora``), as ColossalAI's plugin does when an
optimizer was built over the base model before ``enable_lora``; only the adapters train and the frozen base
weights are not sharded. The layers here are named as peft names them (``<layer>.base_layer``,
``<layer>.lora_A.<adapter>``); peft itself is exercised by stepforge-strategy's Booster tests.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from stepforge.zero import LowLevelZeroOptimizer, LowLevelZeroPlugin
from stepforge.zero.plugin.lora import add_adapters_to_optimizer


class _LoraLinear(nn.Module):
    """peft's ``lora.Linear`` layout: ``base_layer`` plus ``lora_A``/``lora_B`` per adapter."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.base_layer = nn.Linear(n_in, n_out)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(n_in, 1, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(1, n_out, bias=False)})
        with torch.no_grad():
            self.base_layer.weight.fill_(1.0)
            self.base_layer.bias.zero_()
            self.lora_A["default"].weight.fill_(1.0)
            self.lora_B["default"].weight.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _LoraLinear(2, 2)
        self.second = _LoraLinear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _freeze_base(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)


def test_adapters_join_the_group_of_their_base_weight():
    model = _Model()
    # the optimizer was built over the base model, one group per layer (peft then froze these)
    opt = torch.optim.SGD(
        [
            {"params": list(model.first.base_layer.parameters())},
            {"params": list(model.second.base_layer.parameters())},
        ],
        lr=0.1,
    )
    _freeze_base(model)
    added = add_adapters_to_optimizer(model, opt)
    assert added == [
        "first.lora_A.default.weight",
        "first.lora_B.default.weight",
        "second.lora_A.default.weight",
        "second.lora_B.default.weight",
    ]
    first, second = (list(map(id, g["params"])) for g in opt.param_groups)
    assert first[2:] == [id(model.first.lora_A["default"].weight), id(model.first.lora_B["default"].weight)]
    assert second[2:] == [
        id(model.second.lora_A["default"].weight),
        id(model.second.lora_B["default"].weight),
    ]
    assert add_adapters_to_optimizer(model, opt) == []  # already held: nothing is added twice


def test_an_adapter_whose_base_is_not_in_the_optimizer_stays_out_and_is_logged(caplog):
    model = _Model()
    opt = torch.optim.SGD(model.first.base_layer.parameters(), lr=0.1)
    _freeze_base(model)
    with caplog.at_level(logging.WARNING, logger="stepforge.zero"):
        added = add_adapters_to_optimizer(model, opt)
    assert added == ["first.lora_A.default.weight", "first.lora_B.default.weight"]
    assert any("second.lora_A.default.weight" in r.getMessage() for r in caplog.records)
    plain = nn.Linear(2, 2)  # no adapters: nothing happens
    assert add_adapters_to_optimizer(plain, torch.optim.SGD(plain.parameters(), lr=0.1)) == []


def test_the_plugin_trains_only_the_adapters_of_an_optimizer_built_over_the_base_model():
    model = _Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # built before the adapters were "enabled"
    for group in opt.param_groups:  # as peft leaves it: the optimizer holds the base weights only
        group["params"] = [p for n, p in model.named_parameters() if ".lora_" not in n]
    _freeze_base(model)
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32")
    assert plugin.support_lora()
    wrapped, zero = plugin.prepare(model, opt)
    assert isinstance(zero, LowLevelZeroOptimizer)
    managed = {id(p) for p in zero.working_to_master_param.values()}
    assert len(zero.working_to_master_param) == 4 and len(managed) == 4  # the adapters only
    zero.backward(wrapped(torch.ones(1, 2)).sum())
    zero.step()
    # first: base 1s, A = [1, 1], B = [.5, .5]: h = [2 + 1, 2 + 1] = [3, 3]; second: A h = 6, out = 6 + .5 * 6 = 9
    # d out / d second.B = A h = 6 -> B = .5 - .5 * 6 = -2.5; d out / d second.A = B * h = [1.5, 1.5] -> A = .25
    assert model.second.lora_B["default"].weight.tolist() == [[-2.5]]
    assert model.second.lora_A["default"].weight.tolist() == [[0.25, 0.25]]
    assert model.second.base_layer.weight.tolist() == [[1.0, 1.0]]  # frozen: unchanged
    assert model.first.base_layer.weight.tolist() == [[1.0, 1.0], [1.0, 1.0]]
