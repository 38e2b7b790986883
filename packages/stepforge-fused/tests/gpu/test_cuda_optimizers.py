# SPDX-License-Identifier: Apache-2.0
"""The optimizer classes on CUDA tensors: parity with torch.optim / the references, CPU-vs-GPU parity and
``state_dict`` interchange with ``torch.optim`` (``gpu`` marker: skips without a device, fails under
``STEPFORGE_REQUIRE_CUDA=1``)."""

from __future__ import annotations

import copy

import pytest
import torch

from stepforge.testing.reference import ReferenceAdam, ReferenceLamb, reference_adam_step

pytestmark = pytest.mark.gpu

SHAPES = [(1,), (3,), (7, 5), (4096,), (16385,), (3, 3333)]
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module")
def fused(cuda_mod):
    try:
        import stepforge.fused as module

        _ = (module.FusedAdam, module.FusedSGD, module.FusedLAMB)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"stepforge.fused optimizer classes unavailable: {exc}")
    return module


def params(dtype=torch.float32, device="cuda", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in SHAPES]


def set_grads(ps, step, dtype=None):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=dtype or p.dtype)


def run(opt, ps, steps, start=0):
    for s in range(start, start + steps):
        set_grads(ps, s)
        opt.step()
    torch.cuda.synchronize()


def assert_params_close(a, b, **tol):
    tol = tol or dict(rtol=1e-5, atol=1e-6)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.detach().cpu().float(), y.detach().cpu().float(), **tol)


def test_fused_adam_matches_torch_adamw(fused):
    mine, theirs = params(), params()
    run(fused.FusedAdam(mine, **HP), mine, 4)
    run(torch.optim.AdamW(theirs, fused=True, **HP), theirs, 4)
    assert_params_close(mine, theirs)


def test_fused_adam_state_dict_round_trips_with_torch(fused):
    # torch AdamW(fused) -> FusedAdam -> torch AdamW(fused): each leg continues the same trajectory. Each leg
    # loads a deep copy: torch's load_state_dict keeps the very tensors it is given (same dtype and device), so
    # the next leg's steps would otherwise advance the previous optimizer's state too.
    ref = params()
    ref_opt = torch.optim.AdamW(ref, fused=True, **HP)
    run(ref_opt, ref, 6)

    a = params()
    a_opt = torch.optim.AdamW(a, fused=True, **HP)
    run(a_opt, a, 2)
    b = [p.detach().clone().requires_grad_() for p in a]
    b_opt = fused.FusedAdam(b, **HP)
    b_opt.load_state_dict(copy.deepcopy(a_opt.state_dict()))
    run(b_opt, b, 2, start=2)
    c = [p.detach().clone().requires_grad_() for p in b]
    c_opt = torch.optim.AdamW(c, fused=True, **HP)
    c_opt.load_state_dict(copy.deepcopy(b_opt.state_dict()))
    run(c_opt, c, 2, start=4)
    assert_params_close(c, ref)
    for p in b:
        state = b_opt.state[p]
        assert set(state) >= {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == 4.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_adam_low_precision_matches_reference(fused, dtype):
    mine = params(dtype)
    ref = [p.detach().clone() for p in mine]
    m = [torch.zeros(p.shape, device="cuda") for p in ref]
    v = [torch.zeros(p.shape, device="cuda") for p in ref]
    opt = fused.FusedAdam(mine, **HP)
    steps = [0] * len(ref)
    for s in range(3):
        set_grads(mine, s)
        opt.step()
        reference_adam_step(
            ref,
            [p.grad for p in mine],
            m,
            v,
            steps,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            adamw_mode=True,
            bias_correction=True,
        )
    torch.cuda.synchronize()
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=1e-3)
    assert_params_close(mine, ref, **tol)


@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_matches_torch_and_loads_its_state(fused, nesterov):
    hp = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    mine, theirs = params(), params()
    t_opt = torch.optim.SGD(theirs, fused=True, **hp)
    run(t_opt, theirs, 2)
    m_opt = fused.FusedSGD(mine, **hp)
    run(m_opt, mine, 2)
    assert_params_close(mine, theirs)
    # torch's momentum buffers continue inside FusedSGD (a copy: loading keeps the tensors it is given).
    cont = [p.detach().clone().requires_grad_() for p in theirs]
    c_opt = fused.FusedSGD(cont, **hp)
    c_opt.load_state_dict(copy.deepcopy(t_opt.state_dict()))
    run(c_opt, cont, 2, start=2)
    run(t_opt, theirs, 2, start=2)
    assert_params_close(cont, theirs)


def test_fused_lamb_matches_reference(fused):
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
    mine, ref = params(), params()
    run(fused.FusedLAMB(mine, **hp), mine, 3)
    run(ReferenceLamb(ref, **hp), ref, 3)
    assert_params_close(mine, ref, rtol=2e-5, atol=2e-6)
    for p in mine:
        assert p.grad is not None and torch.isfinite(p.grad).all()  # grads are not overwritten with updates


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedLAMB"])
def test_cpu_and_gpu_give_the_same_result(fused, name):
    cls = getattr(fused, name)
    kw = {
        "FusedAdam": dict(HP),
        "FusedSGD": dict(lr=0.05, momentum=0.9),
        "FusedLAMB": dict(lr=1e-2, weight_decay=0.01),
    }[name]
    cpu, gpu = params(device="cpu"), params()
    run(cls(cpu, **kw), cpu, 3)
    run(cls(gpu, **kw), gpu, 3)
    assert_params_close(cpu, gpu, rtol=1e-5, atol=1e-6)


def test_hybrid_adam_steps_cpu_and_cuda_params_together(fused):
    cls = getattr(fused, "HybridAdam", None)
    if cls is None:
        pytest.fail("HybridAdam missing")
    mixed = params(device="cpu")[:3] + params()[3:]
    ref = params(device="cpu")[:3] + params()[3:]
    run(cls(mixed, adamw_mode=True, **HP), mixed, 3)
    run(torch.optim.AdamW(ref, foreach=False, **HP), ref, 3)
    assert_params_close(mixed, ref)


def _max_ulp_distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """Largest distance in float32 units in the last place between paired elements (0: bit-identical)."""
    worst = 0
    for x, y in zip(a, b, strict=True):
        xi = x.detach().float().contiguous().view(torch.int32).long()
        yi = y.detach().float().contiguous().view(torch.int32).long()
        # map the sign-magnitude bit patterns onto one ordered integer line
        xi = torch.where(xi < 0, -(xi & 0x7FFFFFFF), xi)
        yi = torch.where(yi < 0, -(yi & 0x7FFFFFFF), yi)
        worst = max(worst, int((xi - yi).abs().max()))
    return worst


def _ulps_at_scale(a: list[torch.Tensor], b: list[torch.Tensor], floor: float) -> float:
    """Largest ``|a - b|`` in float32 ulps of ``max(|a|, |b|, floor)``: the raw ulp count, except that near zero
    the unit stays the spacing at ``floor`` (a value crossing zero has ulps of 1e-45 and no meaningful count)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = x.detach().double(), y.detach().double()
        scale = torch.maximum(
            torch.maximum(x.abs(), y.abs()), torch.tensor(floor, dtype=torch.float64, device=x.device)
        )
        s32 = scale.float()
        ulp = (torch.nextafter(s32, torch.full_like(s32, float("inf"))) - s32).double()
        worst = max(worst, float(((x - y).abs() / ulp).max()))
    return worst


def test_fused_sgd_is_bit_identical_to_torch_fused_sgd_after_ten_steps(fused, record_testsuite_property):
    # FusedSGD follows torch's fused SGD operation order, so ten steps give the same bits (0 ulps apart).
    hp = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    mine, theirs = params(), params()
    run(fused.FusedSGD(mine, **hp), mine, 10)
    run(torch.optim.SGD(theirs, fused=True, **hp), theirs, 10)
    worst = _max_ulp_distance(mine, theirs)
    record_testsuite_property("max_ulp_sgd", worst)
    assert worst == 0


def test_fused_adam_distance_to_torch_fused_adamw_is_rounding(fused, record_testsuite_property):
    # FusedAdam evaluates torch's fused *CPU* AdamW operation order in float32; torch's CUDA kernel has an order
    # of its own, so the two differ by rounding only. Both are measured against a float64 run of the same ten
    # steps, in float32 ulps of max(|p|, lr), recorded in the junit report as suite properties (H200, torch
    # 2.11: FusedAdam 8.8 from float64, torch 54.6, the two 59 apart; the raw count, 2412, comes from an element
    # near zero). Bound: each step adds at most a few ulps of the param (decay, the final add) and of the update
    # (|update| <= ~lr), so ten steps stay within 64 units.
    mine, theirs, exact = params(), params(), params(dtype=torch.float64)
    run(fused.FusedAdam(mine, **HP), mine, 10)
    run(torch.optim.AdamW(theirs, fused=True, **HP), theirs, 10)
    run(ReferenceAdam(exact, adamw_mode=True, **HP), exact, 10)
    lr = HP["lr"]
    figures = {
        # the raw count is inflated by values near zero: recorded, not bounded
        "max_ulp_adam_raw": _max_ulp_distance(mine, theirs),
        "ulps_adam_vs_torch": _ulps_at_scale(mine, theirs, lr),
        "ulps_adam_vs_float64": _ulps_at_scale(mine, exact, lr),
        "ulps_torch_vs_float64": _ulps_at_scale(theirs, exact, lr),
    }
    for key, value in figures.items():
        record_testsuite_property(key, value)
    print(figures)
    assert figures["ulps_adam_vs_torch"] <= 64
    assert figures["ulps_adam_vs_float64"] <= 64
    # not a do-nothing pass: the params moved by about 10 * lr
    assert (
        max(float((a.detach() - b.detach().float()).abs().max()) for a, b in zip(mine, params(), strict=True))
        > 5 * lr
    )


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedLAMB"])
def test_step_on_a_side_stream_waits_for_the_grads_queued_there(fused, name):
    # step() launches on the caller's current stream: grads written on a busy side stream are read after they
    # are written, with no synchronisation in between. A launch on any other stream would read the grads
    # before the side stream (held up by a ~50 ms spin) has written them.
    hp = dict(lr=1e-2) if name != "FusedAdam" else HP
    mine, theirs = params(), params()
    ours, ref = getattr(fused, name)(mine, **hp), getattr(fused, name)(theirs, **hp)
    for p in mine:
        p.grad = torch.zeros_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # about 50 ms of spinning on this stream
        for i, p in enumerate(mine):
            p.grad.fill_(0.25 * (i + 1))
        ours.step()
    torch.cuda.current_stream().wait_stream(side)
    for i, p in enumerate(theirs):
        p.grad = torch.full_like(p, 0.25 * (i + 1))
    ref.step()
    torch.cuda.synchronize()
    for x, y in zip(mine, theirs, strict=True):
        assert torch.equal(x.detach(), y.detach())
