# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer`` on CUDA parameters, 1 NCCL rank: stage 1 and 2, bf16 and fp16 working parameters
with fp32 masters, ``cpu_offload`` off and on, against plain ``torch.optim.AdamW`` on fp32 copies.

The gradients are written out (``backward_by_grad`` of the concatenated parameters), so both runs see the same
values: the reference's fp32 parameters start at the working parameters' rounded values and take the
gradients rounded to the working dtype. fp16 runs loss scaling (initial scale 2**10, hysteresis 1): the scaled
gradients and their unscaling are exact (powers of two, no overflow), and step ``OVERFLOW_AT`` carries an inf,
so that step is skipped (parameters untouched, the scale halves) and the following steps go on; the reference
skips the same step.

Tolerances on the fp32 masters after ``STEPS`` AdamW steps (lr 1e-2, so every element moves ~1e-2 a step):
without offload the inner optimizer is torch's AdamW on the same device, rtol 1e-6 / atol 1e-7; with offload the
Adam-family config becomes stepforge-fused's ``CPUAdam`` on the CPU, rtol 1e-5 / atol 1e-6 (another kernel's
rounding). The working parameters equal the masters cast to the working dtype, bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.testing.gpu import run_on_one_gpu

pytestmark = pytest.mark.gpu

SHAPES = ((33, 17), (17,), (5, 3))  # odd sizes: no piece lines up with a bucket
STEPS = 5
OVERFLOW_AT = 2
LR, WD = 1e-2, 0.01
MAX_NORM = 0.5  # far below the gradient norm (about 24): the clipped cases really clip
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASES = [
    (stage, precision, offload, None) for stage in (1, 2) for precision in DTYPES for offload in (False, True)
] + [(2, "bf16", False, MAX_NORM), (1, "fp16", True, MAX_NORM)]


def _start() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [0.5 * torch.randn(shape, generator=g) for shape in SHAPES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Step ``step``'s gradients (fp32, on the CPU), already rounded to the working dtype."""
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(shape, generator=g).to(dtype).float() for shape in SHAPES]
    if dtype == torch.float16 and step == OVERFLOW_AT:
        grads[0][3, 4] = float("inf")
    return grads


def _reference(precision: str, max_norm: float | None, device: str) -> list[torch.Tensor]:
    """Plain torch AdamW on fp32 copies of the rounded start, the same gradients, the same skipped step."""
    dtype = DTYPES[precision]
    params = [nn.Parameter(p.to(dtype).float().to(device)) for p in _start()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    for step in range(STEPS):
        grads = _grads(step, dtype)
        if any(not torch.isfinite(g).all() for g in grads):
            continue  # the overflow step: skipped
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(device)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
    return [p.detach().cpu() for p in params]


def _zero_run(stage: int, precision: str, offload: bool, max_norm: float | None, device: str) -> dict:
    from stepforge.zero.low_level import LowLevelZeroOptimizer

    dtype = DTYPES[precision]
    params = [nn.Parameter(p.to(device, dtype)) for p in _start()]
    inner = (
        dict(type="AdamW", lr=LR, weight_decay=WD)  # becomes CPUAdam under offload
        if offload
        else torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    )
    opt = LowLevelZeroOptimizer(
        inner,
        params=params if offload else None,
        stage=stage,
        cpu_offload=offload,
        initial_scale=2**10,
        hysteresis=1,
        growth_interval=1000,
        max_norm=max_norm or 0.0,
        reduce_bucket_size=64,
    )
    out: dict = {"inner": type(opt.optim).__name__, "trace": []}
    for step in range(STEPS):
        before = [p.detach().clone() for p in params]
        scale = opt.loss_scale
        flat = torch.cat([p.reshape(-1) for p in params])
        grad = torch.cat([g.reshape(-1) for g in _grads(step, dtype)]).to(device, dtype)
        opt.backward_by_grad(flat, grad)
        opt.step()
        opt.zero_grad()
        moved = any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
        out["trace"].append((opt.last_step_skipped, moved, scale, opt.loss_scale))
    masters = [opt.working_to_master_param[id(p)] for p in params]
    out["master_device"] = masters[0].device.type
    out["masters"] = [m.detach().float().cpu().view(p.shape) for m, p in zip(masters, params, strict=True)]
    out["working"] = [p.detach().cpu() for p in params]
    out["working_device"] = params[0].device.type
    return out


def _all_cases(rank: int, world: int, device: str) -> dict:
    assert torch.distributed.get_backend() == ("nccl" if device == "cuda" else "gloo")
    return {
        "zero": {case: _zero_run(*case, device) for case in CASES},
        "reference": {(p, n): _reference(p, n, device) for _, p, _, n in CASES},
    }


@pytest.fixture(scope="module")
def results() -> dict:
    return run_on_one_gpu(_all_cases, "cuda", timeout=400)


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}-offload{o}-clip{n}" for s, p, o, n in CASES])
def test_masters_match_fp32_adamw(results: dict, case: tuple) -> None:
    _stage, precision, offload, max_norm = case
    out = results["zero"][case]
    expected = results["reference"][(precision, max_norm)]
    assert out["working_device"] == "cuda"
    assert out["master_device"] == ("cpu" if offload else "cuda")
    assert out["inner"] == ("CPUAdam" if offload else "AdamW")
    tol = dict(rtol=1e-5, atol=1e-6) if offload else dict(rtol=1e-6, atol=1e-7)
    start = _start()
    for master, ref, first in zip(out["masters"], expected, start, strict=True):
        assert (ref - first.to(DTYPES[precision]).float()).abs().mean() > 1e-3  # a do-nothing step fails
        torch.testing.assert_close(master, ref, **tol)
    for working, master in zip(out["working"], out["masters"], strict=True):
        assert torch.equal(working, master.to(DTYPES[precision]))


@pytest.mark.parametrize(
    "case", [c for c in CASES if c[1] == "fp16"], ids=lambda c: f"stage{c[0]}-offload{c[2]}"
)
def test_fp16_overflow_step_is_skipped_then_steps_resume(results: dict, case: tuple) -> None:
    trace = results["zero"][case]["trace"]
    for step, (skipped, moved, scale, new_scale) in enumerate(trace):
        if step == OVERFLOW_AT:
            assert skipped and not moved and new_scale == scale / 2, (step, trace[step])
        else:
            assert not skipped and moved and new_scale == scale, (step, trace[step])
    assert trace[0][2] == 2**10


def test_bf16_runs_without_loss_scaling(results: dict) -> None:
    for case, out in results["zero"].items():
        if case[1] == "bf16":
            assert all(not skipped and moved and scale == 1.0 for skipped, moved, scale, _ in out["trace"])
