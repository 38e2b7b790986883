# SPDX-License-Identifier: Apache-2.0
"""The `_cpu` kernels' unscaled-grad write-back (``write_unscaled_grads``, torch's fused grad_scale contract)
for Adam, SGD and LAMB."""

from __future__ import annotations

import pytest
import torch

from stepforge.fused import _backend
from stepforge.testing.fused_cases import DTYPE_COMBOS as COMBOS
from stepforge.testing.fused_cases import combo_id
from stepforge.testing.fused_cases import pointer_array as ptrs
from stepforge.testing.fused_cases import random_tensors as make
from stepforge.testing.fused_cases import sizes_array as sizes_of

cpu = _backend.cpu_module()
CODE = _backend.DTYPE_CODES


# ---- unscaled-grad write-back (torch's fused grad_scale contract) ---------------------------------------------
def _run_op(op, params, grads, state, masters, pdt, gdt, divisor, **kw):
    """One step of `op` with fixed hyper-parameters; state is (m, v) for adam/lamb, bufs for sgd."""
    common = dict(grad_divisor=divisor, found_inf_ptr=0, check_finite=False, ctx=0)
    common.update(kw)
    if op == "adam":
        m, v = state
        return cpu.adam(
            ptrs(params), ptrs(grads), ptrs(m), ptrs(v), ptrs(masters) if masters else None, sizes_of(params),
            [2] * len(params), CODE[pdt], CODE[gdt], 1e-2, 0.9, 0.99, 1e-8, 0.05, False, True, **common,
        )  # fmt: skip
    if op == "sgd":
        return cpu.sgd(
            ptrs(params), ptrs(grads), ptrs(state), ptrs(masters) if masters else None, sizes_of(params),
            [0] * len(params), CODE[pdt], CODE[gdt], 0.1, 0.9, 0.1, 0.01, True, False, **common,
        )  # fmt: skip
    m, v = state
    return cpu.lamb(
        ptrs(params), ptrs(grads), ptrs(m), ptrs(v), ptrs(masters) if masters else None, sizes_of(params),
        [2] * len(params), CODE[pdt], CODE[gdt], 1e-2, 0.9, 0.999, 1e-6, 0.01, False, True, True, False,
        0.0, float("inf"), **common,
    )  # fmt: skip


def _fresh_state(op, params):
    n = [p.numel() for p in params]
    if op == "sgd":
        return [torch.randn(k) for k in n]
    return [torch.randn(k) for k in n], [torch.rand(k) for k in n]


def _flat(ts):
    return torch.cat([t.flatten().float() for t in ts]) if ts else torch.zeros(0)


@pytest.mark.parametrize("op", ["adam", "sgd", "lamb"])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_write_unscaled_grads_stores_grad_over_divisor_and_changes_nothing_else(isa, op, combo):
    """write_unscaled_grads=True leaves g / divisor (rounded to the grad dtype) in the grads; params, masters and
    state come out bit for bit as without the write-back; the default leaves the grads untouched."""
    pdt, gdt, master = combo
    divisor = 3.0 if op == "adam" else 1024.0  # Adam divides (torch's order); SGD/LAMB multiply by 1/divisor
    params0 = make(pdt)
    grads0 = [(g.float() * 4096).to(gdt) for g in make(gdt)]
    state0 = _fresh_state(op, params0)
    runs = {}
    for write in (False, True):
        params = [p.clone() for p in params0]
        grads = [g.clone() for g in grads0]
        state = [s.clone() for s in state0] if op == "sgd" else tuple([s.clone() for s in x] for x in state0)
        masters = [p.float() for p in params] if master else None
        assert (
            _run_op(op, params, grads, state, masters, pdt, gdt, divisor, write_unscaled_grads=write) is False
        )
        flat_state = state if op == "sgd" else state[0] + state[1]
        runs[write] = (grads, [_flat(params), _flat(masters or []), _flat(flat_state)])
    for g, g0 in zip(runs[False][0], grads0, strict=True):
        assert torch.equal(g.view(torch.uint8), g0.view(torch.uint8)), "default: grads are never modified"
    for g, g0 in zip(runs[True][0], grads0, strict=True):
        want = (g0.float() / divisor).to(gdt)  # exact for a power-of-two divisor, torch's division for 3
        assert torch.equal(g.view(torch.uint8), want.view(torch.uint8))
    for a, b in zip(runs[False][1], runs[True][1], strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (
            "the update must not depend on the write-back"
        )


@pytest.mark.parametrize("op", ["adam", "sgd", "lamb"])
def test_write_unscaled_grads_leaves_grads_alone_when_skipped_or_divisor_is_one(isa, op):
    """torch writes nothing when found_inf is set; neither do we. A divisor of 1 writes nothing either."""
    f32 = torch.float32
    params = make(f32)
    before = [p.clone() for p in params]
    state = _fresh_state(op, params)
    grads0 = make(f32)
    grads0[4][3] = float("inf")
    flag = torch.zeros(1)
    # check_finite finds the inf: the step is skipped, grads included
    grads = [g.clone() for g in grads0]
    kw = dict(found_inf_ptr=flag.data_ptr(), check_finite=True, write_unscaled_grads=True)
    assert _run_op(op, params, grads, state, None, f32, f32, 8.0, **kw) is True
    assert flag.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(grads, grads0, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    # found_inf already set on entry (GradScaler's protocol), finite grads: skipped, grads untouched
    grads0[4][3] = 1.0
    grads = [g.clone() for g in grads0]
    kw = dict(found_inf_ptr=flag.data_ptr(), write_unscaled_grads=True)
    assert _run_op(op, params, grads, state, None, f32, f32, 8.0, **kw) is True
    assert all(torch.equal(a, b) for a, b in zip(grads, grads0, strict=True))
    # divisor 1: nothing to unscale, the grads stay as they are while the step runs
    assert _run_op(op, params, grads, state, None, f32, f32, 1.0, write_unscaled_grads=True) is False
    assert all(torch.equal(a, b) for a, b in zip(grads, grads0, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


@pytest.mark.parametrize("divisor", [1024.0, 3.0])
def test_write_unscaled_grads_matches_torch_fused_adamw_bit_for_bit(isa, divisor):
    """fp32: the grads torch's fused AdamW leaves behind with grad_scale, and the params it computes."""
    params = make(torch.float32)
    grads = [g * 4096 for g in make(torch.float32)]
    m, v = _fresh_state("adam", params)
    t_params, t_grads, t_m, t_v = ([x.clone() for x in xs] for xs in (params, grads, m, v))
    skipped = cpu.adam(
        ptrs(params), ptrs(grads), ptrs(m), ptrs(v), None, sizes_of(params), [3] * len(params), 0, 0,
        1e-2, 0.9, 0.99, 1e-8, 0.05, True, True, divisor, 0, False, 0, write_unscaled_grads=True,
    )  # fmt: skip
    assert skipped is False
    torch._fused_adamw_(
        t_params, t_grads, t_m, t_v, [], [torch.tensor(3.0) for _ in params], lr=1e-2, beta1=0.9, beta2=0.99,
        weight_decay=0.05, eps=1e-8, amsgrad=False, maximize=False, grad_scale=torch.tensor(divisor),
        found_inf=torch.zeros(()),
    )  # fmt: skip
    for ours, theirs in ((grads, t_grads), (params, t_params), (m, t_m), (v, t_v)):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
