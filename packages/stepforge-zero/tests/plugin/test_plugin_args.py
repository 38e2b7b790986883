# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's ``LowLevelZeroPlugin`` argument list (``colossalai/booster/plugin/low_level_zero_plugin.py`` at
4f9953b) on one process: names, order and defaults, what reaches the optimizer, and the arguments whose effect
shows here (``norm_type``, ``cast_inputs``, ``support_no_sync``, ``model.update_master_params()``). The
2-D grid of ``extra_dp_size`` runs at 4 ranks in ``comm/test_wire_and_grid.py``. Expected values are written out."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

from stepforge.core import HyperParameterError
from stepforge.zero import LowLevelZeroPlugin

COLOSSALAI_PLUGIN_SIGNATURE = [
    ("stage", 1),
    ("precision", "fp16"),
    ("initial_scale", 2**32),
    ("min_scale", 1),
    ("growth_factor", 2),
    ("backoff_factor", 0.5),
    ("growth_interval", 1000),
    ("hysteresis", 2),
    ("max_scale", 2**32),
    ("max_norm", 0.0),
    ("norm_type", 2.0),
    ("reduce_bucket_size_in_m", None),  # differs: None = ColossalAI's 12 off gloo, 4 on gloo (measured)
    ("communication_dtype", None),
    ("overlap_communication", True),
    ("overlap_allgather", False),
    ("cpu_offload", False),
    ("master_weights", True),
    ("verbose", False),
    ("cast_inputs", True),
    ("fp8_communication", False),
    ("use_fp8", False),
    ("extra_dp_size", 1),
]


def test_signature_is_colossalais_in_order_with_its_defaults():
    params = list(inspect.signature(LowLevelZeroPlugin).parameters.values())
    assert [(p.name, p.default) for p in params] == COLOSSALAI_PLUGIN_SIGNATURE


def test_bad_plugin_arguments_name_themselves():
    cases = [
        (dict(use_fp8=True), "use_fp8=True"),
        (dict(extra_dp_size=2), "extra_dp_size=2 needs torch.distributed initialised"),
        (dict(extra_dp_size=0), "extra_dp_size must be an int >= 1"),
        (dict(norm_type=0.0), "norm_type must be > 0"),
        (dict(verbose="yes"), "verbose must be a bool"),
        (dict(cast_inputs=None), "cast_inputs must be a bool"),
    ]
    for kwargs, message in cases:
        with pytest.raises(HyperParameterError, match=message):
            LowLevelZeroPlugin(**kwargs)


def test_arguments_reach_the_optimizer_and_norm_type_is_honoured():
    plugin = LowLevelZeroPlugin(
        stage=2, precision="fp32", max_norm=2.0, norm_type=math.inf, communication_dtype=torch.bfloat16,
        overlap_allgather=True, verbose=True, reduce_bucket_size_in_m=1,
    )  # fmt: skip
    assert plugin.support_no_sync() and LowLevelZeroPlugin(stage=1).support_no_sync()  # both stages here
    w = nn.Parameter(torch.zeros(2))
    _, opt = plugin.prepare(nn.ParameterList([w]), torch.optim.SGD([w], lr=1.0))
    assert (opt.config.stage, opt.config.norm_type, opt.config.verbose, opt.config.overlap_allgather) == (
        2,
        math.inf,
        True,
        True,
    )
    assert opt.communication.dtype == torch.bfloat16 and opt.reduce_bucket_size == 2**20
    (w * torch.tensor([3.0, 4.0])).sum().backward()  # gradient [3, 4]: inf-norm 4 (2-norm 5)
    opt.step()
    # clipped by 2 / 4: [-1.5, -2.0] (a 2-norm clip would give [-1.2, -1.6])
    assert w.detach().tolist() == pytest.approx([-1.5, -2.0], rel=1e-5)


def test_the_plugin_checks_its_config_once_and_passes_it_through_unchanged(monkeypatch):
    import stepforge.core.precision as precision
    import stepforge.zero.plugin.low_level_zero as plugin_module

    calls = []
    checked = precision.validate_loss_scaler_args

    def counting(*args, **kwargs):
        calls.append(args[0])
        return checked(*args, **kwargs)

    monkeypatch.setattr(plugin_module, "validate_loss_scaler_args", counting)
    monkeypatch.setattr("stepforge.zero.low_level.validate_loss_scaler_args", counting)
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32", initial_scale=2**10, max_norm=1.0)
    assert (plugin.config.stage, plugin.config.max_norm, plugin.config.scaler["initial_scale"]) == (
        2,
        1.0,
        2**10,
    )
    assert plugin.config.default_bucket_size == 12 * 2**20  # ColossalAI's plugin default off gloo
    optimizers = []
    for _ in range(2):
        layer = nn.Linear(2, 1)
        optimizers.append(plugin.prepare(layer, torch.optim.SGD(layer.parameters(), lr=0.1))[1])
    assert all(opt.config is plugin.config for opt in optimizers)  # the same object, not a copy
    assert calls == ["LowLevelZeroPlugin"]  # checked once, at the plugin's door


def test_cast_inputs_false_leaves_inputs_alone():
    x = torch.ones(1, 3)  # fp32 input for a bf16 model
    cast = LowLevelZeroPlugin(precision="bf16")
    model, _ = cast.prepare(nn.Linear(3, 2))
    assert model(x).dtype == torch.bfloat16
    raw = LowLevelZeroPlugin(precision="bf16", cast_inputs=False)
    model, _ = raw.prepare(nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match="dtype"):
        model(x)


def test_model_update_master_params_keeps_hand_loaded_weights():
    plugin = LowLevelZeroPlugin(precision="bf16")
    layer = nn.Linear(2, 1, bias=False)
    model, opt = plugin.prepare(layer, torch.optim.SGD(layer.parameters(), lr=0.0))
    new = torch.tensor([[0.5, -2.0]], dtype=torch.bfloat16)
    model.unwrap().load_state_dict({"weight": new})
    model.update_master_params()  # ColossalAI injects this member into the boosted model
    opt.backward(model(torch.ones(1, 2)).sum())
    opt.step()
    assert torch.equal(layer.weight.detach(), new)
