# SPDX-License-Identifier: Apache-2.0
"""Low-precision property tests that a do-nothing optimizer cannot pass, and gradients that stay untouched.

A fixed ``atol``/``rtol`` on bf16/fp16 *parameters* is wider than a few steps' update (bf16 rounds at 2**-8
relative), so an optimizer that never moved would pass it. Here the reference runs in the same dtype
(``stepforge.testing.reference``: fp32 math, rounded to the parameter dtype after every step) and the error is
measured against the *update*:

    ||ours - ref|| <= REL * ||ref - start|| + ||ulp(ref)||          (per tensor, 2-norm)

(``stepforge.testing.fused_cases.check_update_close``). ``ulp(ref)`` is one unit in the last place of each reference element (torch.finfo(dtype).eps * |ref|, at least
the smallest normal), so the allowance is one rounding per element plus a quarter of the update. A do-nothing
optimizer has error ``||ref - start||`` and fails whenever the update is larger than about 1.3 ulps in norm;
the draws below make the update many ulps large (asserted), and every draw checks that "start" fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stepforge.fused import CPUAdam, FusedAdam, FusedLAMB, FusedSGD, HybridAdam
from stepforge.testing.fused_cases import check_update_close, ulp_norm
from stepforge.testing.reference import ReferenceAdam, ReferenceLamb, ReferenceSGD
from stepforge.testing.tensors import make_params

LOW = [torch.bfloat16, torch.float16]


def _params(shapes, dtype, seed):
    return make_params(shapes, dtype, seed=seed)


def _run(make, shapes, dtype, seed, steps):
    params = _params(shapes, dtype, seed)
    opt = make(params)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return [p.detach().clone() for p in params]


CASES = {
    "FusedAdam": (
        lambda ps, o: FusedAdam(ps, lr=o["lr"], weight_decay=o["wd"], betas=o["betas"]),
        lambda ps, o: ReferenceAdam(ps, lr=o["lr"], weight_decay=o["wd"], betas=o["betas"]),
    ),
    "CPUAdam": (
        lambda ps, o: CPUAdam(ps, lr=o["lr"], weight_decay=o["wd"], betas=o["betas"], adamw_mode=False),
        lambda ps, o: ReferenceAdam(ps, lr=o["lr"], weight_decay=o["wd"], betas=o["betas"], adamw_mode=False),
    ),
    "HybridAdam": (
        lambda ps, o: HybridAdam(ps, lr=o["lr"], weight_decay=o["wd"], betas=o["betas"]),
        lambda ps, o: ReferenceAdam(ps, lr=o["lr"], weight_decay=o["wd"], betas=o["betas"]),
    ),
    "FusedLAMB": (
        lambda ps, o: FusedLAMB(ps, lr=o["lr"], weight_decay=o["wd"], betas=o["betas"], max_grad_norm=1.0),
        lambda ps, o: ReferenceLamb(
            ps, lr=o["lr"], weight_decay=o["wd"], betas=o["betas"], max_grad_norm=1.0
        ),
    ),
    "FusedSGD": (
        lambda ps, o: FusedSGD(ps, lr=o["lr"], momentum=o["betas"][0], weight_decay=o["wd"]),
        lambda ps, o: ReferenceSGD(ps, lr=o["lr"], momentum=o["betas"][0], weight_decay=o["wd"]),
    ),
}

shapes_st = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple), min_size=1, max_size=3)
options_st = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([2e-2, 5e-2]),
        "wd": st.sampled_from([0.0, 0.01]),
        "betas": st.sampled_from([(0.9, 0.999), (0.5, 0.99), (0.0, 0.9)]),
    }
)


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=shapes_st, dtype=st.sampled_from(LOW), options=options_st, seed=st.integers(0, 2**16))
def test_low_precision_matches_same_dtype_reference_relative_to_the_update(
    name, shapes, dtype, options, seed
):
    make_ours, make_ref = CASES[name]
    steps = 6
    start = [p.detach().clone() for p in _params(shapes, dtype, seed)]
    ours = _run(lambda ps: make_ours(ps, options), shapes, dtype, seed, steps)
    ref = _run(lambda ps: make_ref(ps, options), shapes, dtype, seed, steps)
    check_update_close(ours, ref, start, name)
    # Where the update is far above rounding level, "did nothing" is caught by the very same check. A draw
    # whose update is within a few ulps (tiny tensors, a trust ratio that shrinks the step) cannot tell the two
    # apart, so it is discarded rather than failed: test_a_do_nothing_step_fails_... covers that case on purpose.
    moved = sum(float((r.float() - s.float()).norm()) for r, s in zip(ref, start, strict=True))
    floor = sum(ulp_norm(r) for r in ref)
    assume(moved > 4 * floor)
    with pytest.raises(AssertionError, match="update"):
        check_update_close(start, ref, start, "do-nothing")


@pytest.mark.parametrize(("dtype", "lr"), [(torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_a_do_nothing_step_fails_the_check_that_the_real_step_passes(dtype, lr):
    """Why the update-relative check exists: the fixed tolerances of the existing low-precision tests (bf16
    rtol=atol=1e-2, fp16 2e-3) let a do-nothing optimizer through; the update-relative check does not."""
    shapes = [(64, 32), (33,)]
    start = [p.detach().clone() for p in _params(shapes, dtype, 5)]
    ours = _run(lambda ps: FusedAdam(ps, lr=lr), shapes, dtype, 5, 3)
    ref = _run(lambda ps: ReferenceAdam(ps, lr=lr), shapes, dtype, 5, 3)
    check_update_close(ours, ref, start)
    old = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    # under the fixed tolerance the do-nothing passes on a large share of the elements ...
    close = [
        torch.isclose(s.float(), r.float(), **old).float().mean().item()
        for s, r in zip(start, ref, strict=True)
    ]
    assert min(close) > 0.3, close  # measured: 42-49% (bf16, lr 1e-2), over 50% (fp16, lr 1e-3)
    # ... and under the update-relative check it fails
    with pytest.raises(AssertionError, match="update"):
        check_update_close(start, ref, start)


GRAD_CASES = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    "FusedAdam-l2": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adamw_mode=False),
    "CPUAdam": lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.1, adamw_mode=False),
    "HybridAdam": lambda ps: HybridAdam(ps, lr=1e-2, weight_decay=0.1),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_never_modified(name, dtype):
    """Weight decay, clipping by the global norm and momentum must not write into ``p.grad``."""
    params = _params([(40, 9), (1000,), (3,)], dtype, 3)
    opt = GRAD_CASES[name](params)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 3).to(dtype)
        saved = [p.grad.clone() for p in params]
        before = [p.detach().clone() for p in params]
        opt.step()
        for p, g, b in zip(params, saved, before, strict=True):
            assert torch.equal(p.grad, g)
            assert not torch.equal(p.detach(), b)  # and the step did happen
