# SPDX-License-Identifier: Apache-2.0
"""LowLevelZeroPlugin against core's contract: it subclasses ``Plugin``, its
``prepare`` returns a ``BoostedOptimizer``, its precisions come from ``stepforge.core.precision``, and
``mid_window_save_refusal`` tells whether an accumulation window can be checkpointed (zero1 and zero2, on one
process and on 2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from stepforge.core import BoostedOptimizer, HyperParameterError, Plugin
from stepforge.core.precision import PLUGIN_PRECISIONS
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import mlp, rank_rows, regression_batch
from stepforge.zero import PRECISIONS, LowLevelZeroOptimizer, LowLevelZeroPlugin, Zero1Plugin, Zero2Plugin


def _prepared(plugin: LowLevelZeroPlugin) -> tuple[torch.nn.Module, LowLevelZeroOptimizer]:
    model = mlp((6, 8, 3))
    return plugin.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_subclasses_plugin_base_and_inherits_the_process_facts():
    assert issubclass(LowLevelZeroPlugin, Plugin) and issubclass(Zero2Plugin, Plugin)
    for member in ("world_size", "rank", "device", "prepare_dataloader", "configure", "explicit_precision"):
        assert member not in vars(LowLevelZeroPlugin), member  # inherited, not re-implemented
    plugin = Zero1Plugin(precision="fp32")
    assert (plugin.world_size, plugin.rank, plugin.device) == (1, 0, torch.device("cpu"))
    assert plugin.control_precision() and plugin.supported_precisions() == list(PLUGIN_PRECISIONS)
    assert dict(PRECISIONS) == {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def test_precision_names_follow_the_core_table():
    assert (
        LowLevelZeroPlugin(precision="BF16").precision == "bf16"
    )  # aliases and case, as the table reads them
    assert LowLevelZeroPlugin(precision="float16").dtype == torch.float16
    default = LowLevelZeroPlugin()
    assert default.precision == "fp16" and not default.explicit_precision
    assert Zero2Plugin(precision="fp16").explicit_precision
    with pytest.raises(
        HyperParameterError, match="precision must be one of 'fp32', 'fp16', 'bf16', got 'fp8'"
    ):
        LowLevelZeroPlugin(precision="fp8")
    plugin = LowLevelZeroPlugin(precision="fp32")
    _prepared(plugin)
    with pytest.raises(HyperParameterError, match="already prepared in 'fp32'"):
        plugin.set_precision("bf16")
    with pytest.raises(HyperParameterError, match="LowLevelZeroPlugin: initial_scale must lie in"):
        LowLevelZeroPlugin(initial_scale=2.0**40)  # checked by core's validate_loss_scaler_args


def test_prepare_returns_a_boosted_optimizer():
    model, opt = _prepared(LowLevelZeroPlugin(stage=2, precision="fp16", initial_scale=8.0))
    assert isinstance(opt, BoostedOptimizer) and isinstance(opt, LowLevelZeroOptimizer)
    assert isinstance(opt.unwrap(), torch.optim.SGD)
    assert opt.unwrap() is opt.optim
    # the scaler's state is part of the optimizer's own state dict; nothing travels beside it
    assert opt.scaler_state_dict() is None
    assert opt.state_dict()["zero"]["loss_scaler"]["scale"] == 8.0
    opt.load_scaler_state_dict({"scale": 2.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 5, "_growth_tracker": 3})  # a GradScaler state  # fmt: skip
    assert opt.loss_scale == 2.0 and opt.scaler.state_dict()["_growth_tracker"] == 3
    opt.load_scaler_state_dict(None)
    assert opt.loss_scale == 2.0
    # backward(loss) scales: the pieces hold scale * gradient until unscale_
    x, y = regression_batch(0, 4, 6, 3)
    opt.backward(torch.nn.functional.mse_loss(model(x).float(), y))
    opt.sync_grads()
    scaled = [s.grad.clone() for s in opt.layout.slots]
    opt.unscale_()
    opt.unscale_()  # once per step
    for before, slot in zip(scaled, opt.layout.slots, strict=True):
        torch.testing.assert_close(slot.grad, before / 2.0, rtol=0, atol=0)


def _window(plugin: LowLevelZeroPlugin, rank: int, world: int) -> list[str | None]:
    """``mid_window_save_refusal`` after: no backward, a no_sync backward, a synchronised one, zero_grad."""
    model, opt = _prepared(plugin)
    x, y = regression_batch(1, 4, 6, 3)
    rows = rank_rows(rank, world, 4)
    out = [plugin.mid_window_save_refusal(opt)]
    with plugin.no_sync(model, opt):
        plugin.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]), opt)
    out.append(plugin.mid_window_save_refusal(opt))
    plugin.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]), opt)
    out.append(plugin.mid_window_save_refusal(opt))
    opt.step()
    opt.zero_grad()
    out.append(plugin.mid_window_save_refusal(None))  # the one prepared optimizer
    return out


def _check_window(answers: list[str | None], stage: int) -> None:
    fresh, under_no_sync, synchronised, after_step = answers
    assert fresh is None and under_no_sync is None and after_step is None
    assert synchronised is not None
    assert synchronised.startswith(f"stage {stage} already reduced part of this accumulation window")


@pytest.mark.parametrize("plugin_cls", [Zero1Plugin, Zero2Plugin])
def test_mid_window_save_refusal_one_process(plugin_cls):
    plugin = plugin_cls(precision="fp32")
    _check_window(_window(plugin, 0, 1), plugin.stage)


def _window_two_ranks(rank: int, world: int) -> dict:
    return {
        stage: _window(cls(precision="fp32"), rank, world)
        for stage, cls in ((1, Zero1Plugin), (2, Zero2Plugin))
    }


@pytest.mark.distributed
@requires_gloo
def test_mid_window_save_refusal_two_ranks():
    for per_rank in run_distributed(_window_two_ranks, 2, timeout=120):
        for stage, answers in per_rank.items():
            _check_window(answers, stage)
