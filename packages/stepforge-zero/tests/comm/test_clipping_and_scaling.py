# SPDX-License-Identifier: Apache-2.0
"""Global-norm clipping against ``torch.nn.utils.clip_grad_norm_``; fp16 overflow skip and loss-scaler state.

The fp16 checks drive the gradients directly with ``backward_by_grad`` (values written out below), so they do
not depend on which fp16 kernels torch has on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stepforge.core import HyperParameterError, build_optimizer
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import (
    batch,
    flat_params,
    loss_fn,
    make_model,
    micro_batches,
    optimizer_cfg,
    param_groups,
    reference_run,
)
from stepforge.zero.low_level import LowLevelZeroOptimizer

pytestmark = [pytest.mark.distributed, requires_gloo]

MAX_NORM = 0.05  # well below the gradient norms of the test model: every step clips


def _clip_norms(rank: int, world: int) -> dict:
    out: dict = {"norms": {}, "params": {}}
    for stage in (1, 2):
        for norm_type in (2.0, math.inf, 1.0):
            model = make_model()
            opt = LowLevelZeroOptimizer(
                build_optimizer(optimizer_cfg("AdamW"), param_groups(model)),
                stage=stage,
                reduce_bucket_size=50,
            )
            x, y = next(micro_batches(0, 1, rank, world, torch.float32))
            opt.backward(loss_fn(model, x, y))
            out["norms"][(stage, norm_type)] = opt.clip_grad_norm_(MAX_NORM, norm_type)
            opt.step()
            out["params"][(stage, norm_type)] = flat_params(model)
        # the max_norm= option clips inside every step
        model = make_model()
        opt = LowLevelZeroOptimizer(
            build_optimizer(optimizer_cfg("AdamW"), param_groups(model)), stage=stage, max_norm=MAX_NORM
        )
        for step in range(3):
            x, y = next(micro_batches(step, 1, rank, world, torch.float32))
            opt.backward(loss_fn(model, x, y))
            opt.step()
            opt.zero_grad()
        out["params"][(stage, "option")] = flat_params(model)
    return out


def test_clipping_equals_torch_clip_grad_norm_on_the_unsharded_model():
    results = run_distributed(_clip_norms, 2, timeout=120)
    for stage in (1, 2):
        for norm_type in (2.0, math.inf, 1.0):
            model = make_model()
            opt = build_optimizer(optimizer_cfg("AdamW"), param_groups(model))
            x, y = batch(0, 0)
            loss_fn(model, x, y).backward()
            expected = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
            opt.step()
            assert expected > 2 * MAX_NORM  # the clip is active
            for rank in range(2):
                got = results[rank]["norms"][(stage, norm_type)]
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
                torch.testing.assert_close(
                    results[rank]["params"][(stage, norm_type)], flat_params(model), rtol=1e-6, atol=1e-7
                )
        ref = flat_params(reference_run("AdamW", 3, max_norm=MAX_NORM)[0])
        torch.testing.assert_close(results[0]["params"][(stage, "option")], ref, rtol=1e-6, atol=1e-7)


# -- fp16 loss scaling -------------------------------------------------------------------------------------
GRADS = (0.25, 0.75)  # rank r's gradient (unscaled); their mean 0.5 is exact in fp16


def _drive(opt: LowLevelZeroOptimizer, p: nn.Parameter, rank: int, overflow: bool) -> None:
    grad = torch.full_like(p, GRADS[rank])
    if overflow and rank == 1:  # only one rank overflows: every rank must skip
        grad[3] = math.inf
    opt.backward_by_grad(p * 1, grad)
    opt.step()
    opt.zero_grad()


def _make_fp16(stage: int) -> tuple[nn.Parameter, LowLevelZeroOptimizer]:
    p = nn.Parameter(torch.ones(10, dtype=torch.float16))
    opt = LowLevelZeroOptimizer(
        torch.optim.SGD([p], lr=0.5),
        stage=stage,
        initial_scale=2**4,
        growth_interval=2,
        hysteresis=2,
        max_scale=2**5,
    )
    return p, opt


def _fp16(rank: int, world: int) -> dict:
    out: dict = {}
    for stage in (1, 2):
        p, opt = _make_fp16(stage)
        trace = []
        # overflow, overflow, clean, clean, clean, overflow
        for overflow in (True, True, False, False, False, True):
            _drive(opt, p, rank, overflow)
            trace.append((opt.last_step_skipped, opt.loss_scale, p.detach().clone()))
        out[(stage, "trace")] = trace
        out[(stage, "skipped")] = opt.skipped_steps
        full = opt.state_dict()
        out[(stage, "scaler")] = full["zero"]["loss_scaler"]
        # round trip: a fresh optimizer continues exactly like this one
        q, fresh = _make_fp16(stage)
        with torch.no_grad():
            q.copy_(p)
        fresh.load_state_dict(full)
        for o, t in ((opt, p), (fresh, q)):
            _drive(o, t, rank, True)  # second overflow in a row: backs off
            _drive(o, t, rank, False)
        out[(stage, "continued")] = [
            (o.loss_scale, o.skipped_steps, t.detach().clone()) for o, t in ((opt, p), (fresh, q))
        ]
    return out


def test_fp16_overflow_skips_on_every_rank_and_the_scaler_state_round_trips():
    results = run_distributed(_fp16, 2, timeout=120)
    # written out: hysteresis 2 -> the 2nd overflow halves 16 to 8; 2 clean steps grow to 16, capped at 32
    expected = [
        (True, 16.0, 1.0),
        (True, 8.0, 1.0),
        (False, 8.0, 0.75),  # p -= 0.5 * mean(0.25, 0.75)
        (False, 16.0, 0.5),
        (False, 16.0, 0.25),
        (True, 16.0, 0.25),  # hysteresis budget refilled on growth: the first overflow only counts
    ]
    for rank in range(2):
        for stage in (1, 2):
            trace = results[rank][(stage, "trace")]
            for i, ((skipped, scale, value), (e_skip, e_scale, e_value)) in enumerate(
                zip(trace, expected, strict=True)
            ):
                assert skipped is e_skip and scale == e_scale, (rank, stage, i, skipped, scale)
                assert torch.equal(value, torch.full((10,), e_value, dtype=torch.float16)), (rank, stage, i)
            assert results[rank][(stage, "skipped")] == 3
            scaler = results[rank][(stage, "scaler")]
            assert (scaler["scale"], scaler["growth_tracker"], scaler["hysteresis_left"]) == (16.0, 0, 1)
            original, restored = results[rank][(stage, "continued")]
            assert original[0] == restored[0] == 8.0  # the restored hysteresis budget (1) backs off at once
            assert original[1] == restored[1] == 4
            assert torch.equal(original[2], restored[2])
            assert torch.equal(original[2], torch.zeros(10, dtype=torch.float16))  # 0.25 - 0.5 * 0.5


def test_bad_arguments_name_the_parameter():
    p = nn.Parameter(torch.ones(3))
    with pytest.raises(HyperParameterError, match="stage must be 1 or 2"):
        LowLevelZeroOptimizer(torch.optim.SGD([p], lr=0.1), stage=3)
    with pytest.raises(HyperParameterError, match="reduce_bucket_size"):
        LowLevelZeroOptimizer(torch.optim.SGD([p], lr=0.1), reduce_bucket_size=0)
    with pytest.raises(HyperParameterError, match="max_norm"):
        LowLevelZeroOptimizer(torch.optim.SGD([p], lr=0.1), max_norm=-1.0)
    with pytest.raises(HyperParameterError, match="params="):
        LowLevelZeroOptimizer(dict(type="SGD", lr=0.1))
    with pytest.raises(HyperParameterError, match="initial_scale"):
        LowLevelZeroOptimizer(torch.optim.SGD([p], lr=0.1), initial_scale=0.5, min_scale=1)
    with pytest.raises(HyperParameterError, match="dtype_for_loss_scaling"):
        LowLevelZeroOptimizer(torch.optim.SGD([p], lr=0.1), dtype_for_loss_scaling="bf16")
    opt = LowLevelZeroOptimizer(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(RuntimeError, match="inside no_sync"), opt.no_sync():
        opt.step()
    with pytest.raises(RuntimeError, match="partitioned at construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
