# SPDX-License-Identifier: Apache-2.0
"""The `_cpu` kernels called directly: SGD, LAMB, l2norm and scale against the written-out references
(see test_adam_kernel.py for the conventions)."""

from __future__ import annotations

import array
import math

import pytest
import torch

from stepforge.fused import _backend
from stepforge.testing.fused_cases import DTYPE_COMBOS as COMBOS
from stepforge.testing.fused_cases import F32_TOL, combo_id
from stepforge.testing.fused_cases import KERNEL_DTYPES as DTYPES
from stepforge.testing.fused_cases import KERNEL_SIZES as SIZES
from stepforge.testing.fused_cases import check_kernel_params as _check_params
from stepforge.testing.fused_cases import kernel_state as _state
from stepforge.testing.fused_cases import pointer_array as ptrs
from stepforge.testing.fused_cases import random_tensors as make
from stepforge.testing.fused_cases import sizes_array as sizes_of
from stepforge.testing.reference import reference_lamb_step, reference_sgd_step

cpu = _backend.cpu_module()
CODE = _backend.DTYPE_CODES


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize(
    "cfg",
    [
        dict(momentum=0.0, dampening=0.0, nesterov=False, wd_after_momentum=False),
        dict(momentum=0.9, dampening=0.2, nesterov=False, wd_after_momentum=False),
        dict(momentum=0.9, dampening=0.0, nesterov=True, wd_after_momentum=True),
    ],
    ids=["plain", "momentum-dampening", "nesterov-wd-after"],
)
def test_sgd_matches_reference(combo, cfg):
    pdt, gdt, master = combo
    params = make(pdt)
    masters, _, _ = _state(params, master)
    bufs = [torch.zeros(p.numel()) for p in params] if cfg["momentum"] else None
    ref_bufs = [None] * len(params)
    first = [1] * len(params)
    for _ in range(3):
        before = [p.clone() for p in params]
        ref_p = [w.clone() for w in masters] if master else [p.clone() for p in params]
        if bufs and not first[0]:
            ref_bufs = [b.clone() for b in bufs]
        grads = make(gdt)
        cpu.sgd(
            ptrs(params), ptrs(grads), ptrs(bufs) if bufs else None, ptrs(masters) if master else None,
            sizes_of(params), array.array("q", first), CODE[pdt], CODE[gdt], 0.1, cfg["momentum"],
            cfg["dampening"], 0.01, cfg["nesterov"], cfg["wd_after_momentum"], 1.0, 0, False, 0,
        )  # fmt: skip
        first = [0] * len(params)
        reference_sgd_step(
            ref_p, grads, ref_bufs, lr=0.1, momentum=cfg["momentum"], dampening=cfg["dampening"],
            nesterov=cfg["nesterov"], weight_decay=0.01, wd_after_momentum=cfg["wd_after_momentum"],
        )  # fmt: skip
        _check_params(params, masters, ref_p, before, pdt, master)
        if bufs:
            for b, rb in zip(bufs, ref_bufs, strict=True):
                torch.testing.assert_close(b, rb.float(), **F32_TOL)


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize(
    "wd,nvlamb,clip",
    [(0.01, False, (0.0, float("inf"))), (0.0, False, (0.0, float("inf"))), (0.0, True, (0.5, 2.0))],
    ids=["decay", "no-decay", "nvlamb-clip"],
)
def test_lamb_matches_reference(combo, wd, nvlamb, clip):
    pdt, gdt, master = combo
    params = make(pdt, SIZES[1:])
    masters, m, v = _state(params, master)
    for step in range(1, 3):
        before = [p.clone() for p in params]
        ref_p = [w.clone() for w in masters] if master else [p.clone() for p in params]
        ref_m, ref_v, ref_steps = [x.clone() for x in m], [x.clone() for x in v], [step - 1] * len(params)
        grads = make(gdt, SIZES[1:])
        cpu.lamb(
            ptrs(params), ptrs(grads), ptrs(m), ptrs(v), ptrs(masters) if master else None, sizes_of(params),
            [step] * len(params), CODE[pdt], CODE[gdt], 1e-2, 0.9, 0.999, 1e-6, wd, True, True, True, nvlamb,
            clip[0], clip[1], 1.0, 0, False, 0,
        )  # fmt: skip
        reference_lamb_step(
            ref_p, grads, ref_m, ref_v, ref_steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=wd,
            use_nvlamb=nvlamb, max_grad_norm=None, trust_clip=None if clip[1] == float("inf") else clip,
        )  # fmt: skip
        # the trust ratio is a norm over the whole tensor (sums in another order): a few fp32 ulps
        _check_params(params, masters, ref_p, before, pdt, master)
        for i in range(len(params)):
            torch.testing.assert_close(m[i], ref_m[i], **F32_TOL)
            torch.testing.assert_close(v[i], ref_v[i], **F32_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_global_and_per_tensor(isa, dtype):
    xs = make(dtype)
    out = torch.full((len(xs),), -1.0)
    got = cpu.l2norm(ptrs(xs), sizes_of(xs), CODE[dtype], out.data_ptr(), 0)
    want = [torch.linalg.vector_norm(x.double()).item() for x in xs]
    assert got == pytest.approx(math.sqrt(sum(w * w for w in want)), rel=1e-12)
    torch.testing.assert_close(out, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=0)
    assert out[0].item() == 0.0  # the empty tensor


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_l2norm_propagates_non_finite_values_to_that_tensor_and_the_total(isa, dtype, bad):
    xs = make(dtype)
    xs[-2][5] = bad
    out = torch.full((len(xs),), -1.0)
    got = cpu.l2norm(ptrs(xs), sizes_of(xs), CODE[dtype], out.data_ptr(), 0)
    if math.isnan(bad):
        assert math.isnan(got) and math.isnan(out[-2].item())
    else:
        assert got == math.inf and out[-2].item() == math.inf
    finite = [i for i in range(len(xs)) if i != len(xs) - 2]
    want = torch.tensor(
        [torch.linalg.vector_norm(xs[i].double()).item() for i in finite], dtype=torch.float32
    )
    torch.testing.assert_close(out[finite], want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_scale_converts_with_torch_rounding_and_flags_non_finite(isa, src_dtype, dst_dtype):
    src = make(src_dtype)
    dst = [torch.empty(x.numel(), dtype=dst_dtype) for x in src]
    found = torch.zeros(1)
    args = (ptrs(src), ptrs(dst), sizes_of(src), CODE[src_dtype], CODE[dst_dtype], 0.25, found.data_ptr(), 0)
    assert cpu.scale(*args) is False
    assert found.item() == 0
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d, (s.float() * 0.25).to(dst_dtype))
    src[3][0] = float("inf")
    assert cpu.scale(*args) is True
    assert found.item() == 1
