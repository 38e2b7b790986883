# SPDX-License-Identifier: Apache-2.0
"""ColossalAIOptimWrapper and AmpOptimWrapper (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cases import MICRO, boost, boosted_steps, make_model, make_optimizer, micro_batch, reference_run, window

from stepforge.core import OPTIM_WRAPPERS
from stepforge.strategy import AmpOptimWrapper, ColossalAIOptimWrapper


def test_registered():
    assert OPTIM_WRAPPERS.get("ColossalAIOptimWrapper") is ColossalAIOptimWrapper
    assert OPTIM_WRAPPERS.get("AmpOptimWrapper") is AmpOptimWrapper
    assert issubclass(ColossalAIOptimWrapper, OPTIM_WRAPPERS.get("OptimWrapper"))


def test_partial_last_window_and_counters():
    # counts 3, max 5: steps after micro-batches 3 and 5; the last window (2 micro-batches) divides by 2
    _, model, wrapper = boost("single", k=3)
    wrapper.initialize_count_status(model, 0, 5)
    ref = make_model()
    ref_opt = make_optimizer(ref.parameters())
    xs = [micro_batch(0, m, 0, 1, 5) for m in range(5)]
    for x, y in xs:
        with wrapper.optim_context(model):
            wrapper.update_params(F.mse_loss(model(x), y))
    for chunk in (xs[:3], xs[3:]):
        x = torch.cat([c[0] for c in chunk])
        y = torch.cat([c[1] for c in chunk])
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    state = wrapper.state_dict()
    assert state["accumulation"]["inner_count"] == 5


def test_clip_grad_goes_through_the_booster():
    k = 2
    _, model, wrapper = boost("single", k=k, clip_grad=dict(max_norm=0.05))
    boosted_steps(model, wrapper, 1, 0, 1, k)
    ref = make_model()
    x, y = window(0, k * MICRO)
    F.mse_loss(ref(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    torch.testing.assert_close(wrapper.grad_norm, expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="max_norm"):
        _, m, w = boost("single", clip_grad=dict(max_norm=1.0, foo=2))
        boosted_steps(m, w, 1, 0, 1, 1)


def test_needs_a_booster():
    opt = make_optimizer(make_model().parameters())
    wrapper = ColossalAIOptimWrapper(opt)
    with pytest.raises(RuntimeError, match="no booster"):
        with wrapper.optim_context(make_model()):
            pass
    with pytest.raises(TypeError, match="Booster"):
        ColossalAIOptimWrapper(opt, booster=object())


def _amp_run(steps: int, **kwargs):
    model = make_model()
    wrapper = AmpOptimWrapper(make_optimizer(model.parameters()), **kwargs)
    losses = []
    for step in range(steps):
        x, y = window(step, 8)
        with wrapper.optim_context(model):
            loss = F.mse_loss(model(x).float(), y)
        wrapper.update_params(loss)
        losses.append(loss.item())
    return model, wrapper, losses


def test_amp_optim_wrapper_on_cpu_tracks_fp32():
    _, ref_losses = reference_run(5, rows=8)
    _model, wrapper, losses = _amp_run(5)  # CPU default: bf16, no loss scaling
    assert wrapper.cast_dtype == torch.bfloat16 and not wrapper.loss_scaler.is_enabled()
    assert losses == pytest.approx(ref_losses, abs=3e-2)
    _, w16, losses16 = _amp_run(
        5, dtype="float16", loss_scale=512
    )  # an int scale is fine (mmengine: TypeError)
    assert w16.loss_scaler.is_enabled() and w16.loss_scaler.get_scale() == 512.0
    assert losses16 == pytest.approx(ref_losses, abs=5e-3)
    state = w16.state_dict()
    assert state["loss_scaler"]["scale"] == 512.0
    _, w3, _ = _amp_run(0, dtype=torch.float16, loss_scale=dict(init_scale=64.0, growth_interval=7))
    w3.load_state_dict(state)
    assert w3.loss_scaler.get_scale() == 512.0


def test_amp_optim_wrapper_errors():
    opt = make_optimizer(make_model().parameters())
    with pytest.raises(ValueError, match="dtype must be one of"):
        AmpOptimWrapper(opt, dtype="float8")
    with pytest.raises(TypeError, match="loss_scale"):
        AmpOptimWrapper(opt, loss_scale="static")
    with pytest.raises(ValueError, match="loss_scale must be > 0"):
        AmpOptimWrapper(opt, loss_scale=0)
    with pytest.raises(RuntimeError, match="use_fsdp=True"):
        AmpOptimWrapper(opt, use_fsdp=True)
