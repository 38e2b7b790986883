# SPDX-License-Identifier: Apache-2.0
"""The CPU ``lamb`` binding split in two (``norms_out_ptr`` / ``norms_in_ptr``), used for sharded parameters.

References: the single ``lamb`` call (the split with unchanged sums must give its bits), float64 torch sums of
``p^2`` and ``u^2`` (the Adam direction written out), and ``trust_clip=(1, 1)`` for sums that force a ratio of 1.
"""

from __future__ import annotations

import array

import pytest
import torch

from stepforge.fused import _backend

cpu = _backend.cpu_module()
CODE = _backend.DTYPE_CODES
SIZES = [1, 7, 17, 513, 1001]
COMBOS = [(torch.float32, torch.float32, False), (torch.bfloat16, torch.float16, True)]


def _ptrs(ts):
    return array.array("q", [t.data_ptr() for t in ts]) if ts is not None else None


def _case(pdt, gdt, master, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(pdt) for n in SIZES]
    grads = [torch.randn(n, generator=gen).to(gdt) for n in SIZES]
    masters = [p.float() for p in params] if master else None
    m = [torch.randn(n, generator=gen) * 0.1 for n in SIZES]
    v = [torch.rand(n, generator=gen) * 0.1 for n in SIZES]
    return params, grads, masters, m, v


def _clone(case):
    return tuple(None if x is None else [t.clone() for t in x] for x in case)


def _lamb(case, pdt, gdt, trust=(0.0, float("inf")), divisor=1.0, **kw):
    params, grads, masters, m, v = case
    return cpu.lamb(
        _ptrs(params), _ptrs(grads), _ptrs(m), _ptrs(v), _ptrs(masters), array.array("q", SIZES),
        [3] * len(SIZES), CODE[pdt], CODE[gdt], 1e-2, 0.9, 0.999, 1e-6, 0.01, True, True, True, False,
        trust[0], trust[1], divisor, 0, False, 0, **kw,
    )  # fmt: skip


def _same(a, b):
    return all(
        (x is None and y is None) or all(torch.equal(s, t) for s, t in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("combo", COMBOS, ids=["fp32", "bf16-master"])
def test_split_with_unchanged_sums_gives_the_single_call_bits(combo):
    pdt, gdt, master = combo
    one = _case(pdt, gdt, master)
    two = _clone(one)
    _lamb(one, pdt, gdt, divisor=2.0, write_unscaled_grads=True)
    norms = torch.full((2 * len(SIZES),), float("nan"), dtype=torch.float64)
    before = _clone(two)
    assert (
        _lamb(two, pdt, gdt, divisor=2.0, write_unscaled_grads=True, norms_out_ptr=norms.data_ptr()) is False
    )
    # the norms pass updates the moments (and writes the unscaled grads back) but not the params
    assert _same(two[0], before[0]) and (not master or _same(two[2], before[2]))
    assert _same(two[1], one[1]) and _same(two[3], one[3]) and _same(two[4], one[4])
    # sum p^2 is over the params (the masters when given) before the update, in float64
    src = before[2] if master else before[0]
    want_p = torch.tensor([t.double().pow(2).sum().item() for t in src], dtype=torch.float64)
    torch.testing.assert_close(norms[: len(SIZES)], want_p, rtol=1e-12, atol=0.0)
    # sum u^2, u = m_hat / (sqrt(v_hat) + eps) + wd * p, from the moments the pass wrote (float32 u)
    bc1, bc2 = 1 - 0.9**3, 1 - 0.999**3
    want_u = [
        ((mi / bc1) / ((vi / bc2).sqrt() + 1e-6) + 0.01 * pi.float()).double().pow(2).sum().item()
        for mi, vi, pi in zip(two[3], two[4], src, strict=True)
    ]
    torch.testing.assert_close(
        norms[len(SIZES) :], torch.tensor(want_u, dtype=torch.float64), rtol=1e-5, atol=0
    )
    _lamb(two, pdt, gdt, divisor=2.0, write_unscaled_grads=True, norms_in_ptr=norms.data_ptr())
    assert _same(two, one)  # grads written back once, params and moments bit for bit


def test_apply_pass_takes_the_ratio_from_the_given_sums():
    pdt = gdt = torch.float32
    ref = _case(pdt, gdt, False, seed=1)
    got = _clone(ref)
    _lamb(ref, pdt, gdt, trust=(1.0, 1.0))  # ratio forced to exactly 1
    norms = torch.zeros(2 * len(SIZES), dtype=torch.float64)
    _lamb(got, pdt, gdt, norms_out_ptr=norms.data_ptr())
    norms[len(SIZES) :] = norms[: len(SIZES)] * 1.0  # ||u|| := ||p||: ratio 1 from the given sums
    _lamb(got, pdt, gdt, norms_in_ptr=norms.data_ptr())
    assert _same(got, ref)


def test_norms_out_and_in_together_are_refused():
    case = _case(torch.float32, torch.float32, False)
    norms = torch.zeros(2 * len(SIZES), dtype=torch.float64)
    with pytest.raises(ValueError, match="norms_out_ptr .* or norms_in_ptr"):
        _lamb(
            case, torch.float32, torch.float32, norms_out_ptr=norms.data_ptr(), norms_in_ptr=norms.data_ptr()
        )
