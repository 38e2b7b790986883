# SPDX-License-Identifier: Apache-2.0
"""Mixed precision: names/dicts/instances, fp8's requirement error, fp16_apex, loss scaling, bf16 vs fp32."""

from __future__ import annotations

import logging

import pytest
import torch
from _cases import MICRO, boost, boosted_steps, reference_run

from stepforge.strategy import (
    BF16MixedPrecision,
    Booster,
    DynamicLossScaler,
    FP16ApexMixedPrecision,
    FP16TorchMixedPrecision,
    TorchFSDPPlugin,
    resolve_mixed_precision,
)
from stepforge.strategy import mixed_precision as mp_module

SLOW_ON_CPU = "stepforge.core.precision.SlowConfigurationWarning"


def test_resolve():
    assert resolve_mixed_precision(None) is None
    assert resolve_mixed_precision("fp32") is None
    assert isinstance(resolve_mixed_precision("bf16"), BF16MixedPrecision)
    fp16 = resolve_mixed_precision(dict(type="fp16", init_scale=8.0, growth_interval=3))
    assert isinstance(fp16, FP16TorchMixedPrecision) and fp16.scaler_kwargs["init_scale"] == 8.0
    inst = BF16MixedPrecision()
    assert resolve_mixed_precision(inst) is inst
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        resolve_mixed_precision("fp12")
    with pytest.raises(ValueError, match="'type'"):
        resolve_mixed_precision(dict(init_scale=2.0))
    with pytest.raises(TypeError, match="mixed_precision must be"):
        resolve_mixed_precision(3)
    with pytest.raises(ValueError, match="backoff_factor"):
        FP16TorchMixedPrecision(backoff_factor=2.0)


def test_fp8_names_its_requirement():
    reason = mp_module.fp8_requirement_error()
    if reason is None:
        pytest.skip("this machine can run fp8 (torchao and a GPU of compute capability >= 8.9)")
    with pytest.raises(RuntimeError, match="compute capability 8.9") as err:
        Booster(mixed_precision="fp8")
    assert "torchao" in str(err.value) or "GPU" in str(err.value)


def test_fp16_apex_is_fp16_with_one_note(caplog, monkeypatch):
    monkeypatch.setattr(mp_module, "_APEX_NOTED", False)
    with caplog.at_level(logging.WARNING, logger="stepforge.strategy"):
        a = resolve_mixed_precision("fp16_apex")
        resolve_mixed_precision("fp16_apex")
    assert isinstance(a, FP16ApexMixedPrecision) and a.name == "fp16"
    assert sum("Apex is not used" in r.message for r in caplog.records) == 1
    with pytest.raises(TypeError, match="keep_batchnorm_fp32"):
        FP16ApexMixedPrecision(keep_batchnorm_fp32=True)


def test_precision_conflicts_are_errors():
    with pytest.raises(ValueError, match=r"mixed_precision='bf16'.*'fp16'"):
        Booster(mixed_precision="bf16", plugin=TorchFSDPPlugin(precision="fp16"))
    with pytest.raises(ValueError, match=r"mixed_precision='bf16'.*'fp16'"):
        Booster(mixed_precision="bf16", plugin=dict(type="gemini", precision="fp16"))
    # a plugin instance without an explicit precision takes the Booster's
    plugin = TorchFSDPPlugin()
    Booster(mixed_precision="bf16", plugin=plugin)
    assert plugin.precision == "bf16"
    # built from a name: the precision is passed to the constructor
    assert Booster(mixed_precision="bf16", plugin="gemini").plugin.precision == "bf16"
    assert Booster(mixed_precision="fp16", plugin="torch_fsdp").plugin.precision == "fp16"
    with pytest.raises(ValueError, match="fp8"):
        Booster(mixed_precision=dict(type="fp8"), plugin="torch_fsdp")
    with pytest.raises(ValueError, match="mixed_precision dict needs 'type'"):
        Booster(mixed_precision=dict(type="fp12"), plugin="torch_fsdp")
    # same value on both: fine
    assert (
        Booster(mixed_precision="bf16", plugin=dict(type="gemini", precision="bf16")).plugin.precision
        == "bf16"
    )


def test_dynamic_loss_scaler_follows_grad_scaler():
    # expected scales written out: init 4, x2 after 2 clean steps, x0.5 on an overflow
    flags = [False, False, True, False, False, False]
    expected = [4.0, 8.0, 4.0, 4.0, 8.0, 8.0]
    ours = DynamicLossScaler(init_scale=4.0, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    got, torch_scales = [], []
    for bad in flags:
        for scaler in (ours, theirs):
            scaler.scale(torch.ones(()))  # GradScaler creates its scale lazily here
            p.grad = torch.tensor([1.0, float("inf") if bad else 2.0, 3.0])
            scaler.unscale_(opt)
            if scaler is theirs:
                scaler.step(opt)
            scaler.update()
        got.append(ours.get_scale())
        torch_scales.append(theirs.get_scale())
    assert got == expected == torch_scales
    # hysteresis=2 (ColossalAI's rule, core.precision): the second overflow backs off, and so does every overflow
    # after it until a growth refills the budget; a clean step in between does not
    h = DynamicLossScaler(init_scale=4.0, growth_interval=100, hysteresis=2)
    seq = []
    for bad in [True, True, False, True, False]:
        p.grad = torch.tensor([float("nan") if bad else 1.0, 0.0, 0.0])
        h.unscale_(opt)
        h.update()
        seq.append(h.get_scale())
    assert seq == [4.0, 2.0, 2.0, 1.0, 1.0]
    state = h.state_dict()
    other = DynamicLossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state


@pytest.mark.filterwarnings(f"ignore::{SLOW_ON_CPU}")  # fp16 on CPU is what this tests
def test_fp16_booster_skips_overflow_and_checkpoints_the_scale(tmp_path):
    booster, model, wrapper = boost("single", mixed_precision=dict(type="fp16", init_scale=2.0**10))
    opt = wrapper.optimizer
    assert opt.loss_scale == 2.0**10
    boosted_steps(model, wrapper, 2, 0, 1, 1)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    opt.step()
    assert opt.last_step_skipped and opt.loss_scale == 2.0**9
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)
    opt.zero_grad()
    booster.save_optimizer(opt, tmp_path / "o")
    assert opt.state_dict()["grad_scaler"]["scale"] == 2.0**9
    booster2, _model2, wrapper2 = boost("single", mixed_precision="fp16")
    booster2.load_optimizer(wrapper2.optimizer, tmp_path / "o")
    assert wrapper2.optimizer.loss_scale == 2.0**9


@pytest.mark.filterwarnings(f"ignore::{SLOW_ON_CPU}")  # fp16 on CPU is what this tests
def test_bf16_and_fp16_track_fp32_on_cpu():
    steps, k = 6, 2
    ref, ref_losses = reference_run(steps, rows=k * MICRO)
    for precision, bound in (("bf16", 3e-2), ("fp16", 5e-3)):
        _, model, wrapper = boost("single", mixed_precision=precision, k=k)
        losses = boosted_steps(model, wrapper, steps, 0, 1, k)
        assert next(model.parameters()).dtype == torch.float32  # fp32 master weights
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= bound * max(1.0, abs(b)), (precision, losses, ref_losses)
        diff = max(
            (p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
        assert 0 < diff <= bound, (precision, diff)
