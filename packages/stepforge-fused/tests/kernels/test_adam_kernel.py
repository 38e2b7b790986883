# SPDX-License-Identifier: Apache-2.0
"""The `_cpu` kernels called directly (contract: csrc/README.md): Adam, every ISA, threads, bounds, arguments.

SGD, LAMB, l2norm and scale are in test_op_kernels.py, the unscaled-grad write-back in
test_unscale_kernels.py; the shared helpers in ``stepforge.testing.fused_cases``.

References: stepforge-testing's written-out optimizers run on the same values, rounding to the same storage
dtype every step (so a 16-bit result is compared with what the same step gives in that dtype, not with a
float32 run), and torch's own fused AdamW where the contract is bit identity. Every assertion also fails for a
kernel that does nothing: the updates are several ulps of the stored dtype.
"""

from __future__ import annotations

import array

import pytest
import torch

from stepforge.fused import _backend
from stepforge.testing.fused_cases import DTYPE_COMBOS as COMBOS
from stepforge.testing.fused_cases import F32_TOL, combo_id
from stepforge.testing.fused_cases import KERNEL_SIZES as SIZES
from stepforge.testing.fused_cases import check_kernel_params as _check_params
from stepforge.testing.fused_cases import kernel_state as _state
from stepforge.testing.fused_cases import pointer_array as ptrs
from stepforge.testing.fused_cases import random_tensors as make
from stepforge.testing.fused_cases import raw_bytes as _bits
from stepforge.testing.fused_cases import sizes_array as sizes_of
from stepforge.testing.reference import reference_adam_step

cpu = _backend.cpu_module()
CODE = _backend.DTYPE_CODES


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_adam_matches_reference_for_every_dtype_pair(combo):
    pdt, gdt, master = combo
    params = make(pdt)
    masters, m, v = _state(params, master)
    steps = [0] * len(params)
    for _ in range(3):
        # each step starts the reference from the kernel's values, kept in their storage dtype (fp32 for the
        # master path) and rounded the same way, so 16-bit results are compared one step at a time
        before = [p.clone() for p in params]
        ref_p = [w.clone() for w in masters] if master else [p.clone() for p in params]
        ref_m, ref_v, ref_steps = [x.clone() for x in m], [x.clone() for x in v], list(steps)
        grads = make(gdt)
        steps = [s + 1 for s in steps]
        skipped = cpu.adam(
            ptrs(params), ptrs(grads), ptrs(m), ptrs(v), ptrs(masters) if master else None, sizes_of(params),
            array.array("q", steps), CODE[pdt], CODE[gdt], 1e-2, 0.9, 0.99, 1e-8, 0.05, True, True, 2.0, 0,
            False, 0,
        )  # fmt: skip
        assert skipped is False
        reference_adam_step(
            ref_p, grads, ref_m, ref_v, ref_steps, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05,
            adamw_mode=True, bias_correction=True, grad_scale=2.0,
        )  # fmt: skip
        _check_params(params, masters, ref_p, before, pdt, master)
        for i in range(len(params)):
            torch.testing.assert_close(m[i], ref_m[i], **F32_TOL)
            torch.testing.assert_close(v[i], ref_v[i], **F32_TOL)


def _all_ops_once(params, grads, masters, m, v, bufs, pdt, gdt, ctx=0):
    w = ptrs(masters) if masters else None
    n = len(params)
    cpu.adam(
        ptrs(params), ptrs(grads), ptrs(m), ptrs(v), w, sizes_of(params), [3] * n, CODE[pdt], CODE[gdt],
        1e-2, 0.9, 0.999, 1e-8, 0.01, False, True, 1.0, 0, False, ctx,
    )  # fmt: skip
    cpu.sgd(
        ptrs(params), ptrs(grads), ptrs(bufs), w, sizes_of(params), [1] * n, CODE[pdt], CODE[gdt], 0.1, 0.9,
        0.1, 0.01, False, True, 1.0, 0, False, ctx,
    )  # fmt: skip
    cpu.lamb(
        ptrs(params), ptrs(grads), ptrs(m), ptrs(v), w, sizes_of(params), [4] * n, CODE[pdt], CODE[gdt], 1e-2,
        0.9, 0.999, 1e-6, 0.01, True, True, True, False, 0.0, float("inf"), 1.0, 0, False, ctx,
    )  # fmt: skip


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_every_isa_gives_the_same_bits(combo):
    """The update is element-wise with one rounding order, so every ISA path must agree bit for bit.

    Together with the reference tests (run on the default path) this covers every path the CPU supports.
    """
    pdt, gdt, master = combo
    base = make(pdt)
    grads = make(gdt)
    results = {}
    before = cpu.get_isa()
    try:
        for name in _backend.cpu_features()["supported"]:
            cpu.set_isa(name)
            params = [p.clone() for p in base]
            masters, m, v = _state(params, master)
            bufs = [torch.zeros(p.numel()) for p in params]
            _all_ops_once(params, grads, masters, m, v, bufs, pdt, gdt)
            norms = torch.zeros(len(params))
            cpu.l2norm(ptrs(params), sizes_of(params), CODE[pdt], norms.data_ptr(), 0)
            results[name] = _bits(params) + _bits(masters or []) + _bits(m + v + bufs) + _bits([norms])
    finally:
        cpu.set_isa(before)
    first = next(iter(results.values()))
    assert not torch.equal(first[len(base) - 1], _bits(base)[-1]), "the kernels did not move the params"
    for name, got in results.items():
        for a, b in zip(first, got, strict=True):
            assert torch.equal(a, b), name


def test_element_wise_results_do_not_depend_on_the_thread_count(isa):
    """The concatenated range is split differently for 1 and 2 threads; element-wise updates must not notice."""
    sizes = [70_001, 3, 40_005]  # above the parallel cutoff, tensors cut across chunk boundaries
    base, grads = make(torch.bfloat16, sizes), make(torch.float32, sizes)
    out = []
    for threads in (1, 2):
        params = [p.clone() for p in base]
        masters, m, v = _state(params, True)
        n = len(params)
        cpu.adam(
            ptrs(params), ptrs(grads), ptrs(m), ptrs(v), ptrs(masters), sizes_of(params), [2] * n, 2, 0, 1e-2,
            0.9, 0.999, 1e-8, 0.01, True, True, 4.0, 0, False, threads,
        )  # fmt: skip
        bufs = [torch.zeros(p.numel()) for p in params]
        cpu.sgd(
            ptrs(params), ptrs(grads), ptrs(bufs), ptrs(masters), sizes_of(params), [1] * n, 2, 0, 0.1, 0.9,
            0.0, 0.01, True, False, 1.0, 0, False, threads,
        )  # fmt: skip
        out.append(_bits(params) + _bits(masters) + _bits(m + v + bufs))
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_write_only_inside_their_tensors(isa, dtype):
    """Each tensor is a view at the start of a larger buffer filled with a sentinel: nothing past numel (or
    before the pointer) changes, whatever the dtype's element size -- a kernel reading a 16-bit buffer as
    float32, or writing a whole SIMD vector past the end, fails here."""
    sizes = [1, 7, 17, 513, 40_005]
    pad = 64

    def guarded(n, dt, fill):
        buf = torch.full((n + 2 * pad,), fill, dtype=dt)
        return buf, buf[pad : pad + n]

    def views(dt, fill):
        pairs = [guarded(n, dt, fill) for n in sizes]
        for _, view in pairs:
            view.copy_(torch.randn(view.numel()).to(dt))
        return [b for b, _ in pairs], [v for _, v in pairs]

    pbuf, params = views(dtype, -3.0)
    gbuf, grads = views(dtype, 5.0)
    mbuf, m = views(torch.float32, 7.0)
    vbuf, v = views(torch.float32, 9.0)
    wbuf, masters = views(torch.float32, 11.0)
    for mm, vv in zip(m, v, strict=True):
        mm.zero_()
        vv.fill_(1e-3)
    if dtype == torch.float32:
        masters, wbuf = None, []
    else:
        for w, p in zip(masters, params, strict=True):
            w.copy_(p.float())
    snapshot = [b.clone() for b in pbuf + gbuf + mbuf + vbuf + wbuf]
    bufs_mom = [t.clone() for t in m]
    _all_ops_once(params, grads, masters, m, v, bufs_mom, dtype, dtype)
    n = len(params)
    cpu.adam(
        ptrs(params), ptrs(grads), ptrs(m), ptrs(v), ptrs(masters) if masters else None, sizes_of(params),
        [5] * n, CODE[dtype], CODE[dtype], 1e-2, 0.9, 0.999, 1e-8, 0.0, True, True, 8.0, 0, False, 0,
        write_unscaled_grads=True,
    )  # fmt: skip
    for buf, old in zip(pbuf + gbuf + mbuf + vbuf + wbuf, snapshot, strict=True):
        assert torch.equal(buf[:pad], old[:pad]) and torch.equal(buf[-pad:], old[-pad:])
    assert not torch.equal(pbuf[-1], snapshot[len(sizes) - 1]), "the params were not updated"
    assert not torch.equal(gbuf[-1], snapshot[2 * len(sizes) - 1]), "the grads were not unscaled"


def _adam_args(params, grads, m, v, **kw):
    args = dict(
        params=ptrs(params),
        grads=ptrs(grads),
        exp_avgs=ptrs(m),
        exp_avg_sqs=ptrs(v),
        masters=None,
        sizes=sizes_of(params),
        steps=[1] * len(params),
        param_dtype=0,
        grad_dtype=0,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw_mode=True,
        bias_correction=True,
    )
    args.update(kw)
    return args


def test_found_inf_protocol_skips_without_writing(isa):
    params, grads = make(torch.float32), make(torch.float32)
    m, v = [torch.zeros(p.numel()) for p in params], [torch.zeros(p.numel()) for p in params]
    before = [p.clone() for p in params]
    flag = torch.ones(1)
    assert cpu.adam(**_adam_args(params, grads, m, v), found_inf_ptr=flag.data_ptr()) is True
    grads[-1][17] = float("inf")
    flag.zero_()
    assert (
        cpu.adam(**_adam_args(params, grads, m, v), found_inf_ptr=flag.data_ptr(), check_finite=True) is True
    )
    assert flag.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    assert all(not x.any() for x in m + v)
    # the (divided) grad overflowing counts too: 3e38 / 0.5 is inf in float32
    grads[-1][17] = 3e38
    assert cpu.adam(**_adam_args(params, grads, m, v), grad_divisor=0.5, check_finite=True) is True
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    assert cpu.adam(**_adam_args(params, grads, m, v), grad_divisor=2.0, check_finite=True) is False
    assert not torch.equal(params[-1], before[-1])


def test_pointer_lists_accept_lists_and_int64_buffers(isa):
    params, grads = make(torch.float32, [5, 9]), make(torch.float32, [5, 9])
    results = []
    for as_lists in (False, True):
        ps = [p.clone() for p in params]
        m, v = [torch.zeros(p.numel()) for p in ps], [torch.zeros(p.numel()) for p in ps]
        args = _adam_args(ps, grads, m, v)
        if as_lists:
            args.update(
                params=[p.data_ptr() for p in ps],
                grads=[g.data_ptr() for g in grads],
                exp_avgs=[t.data_ptr() for t in m],
                exp_avg_sqs=[t.data_ptr() for t in v],
                sizes=[5, 9],
            )
        assert cpu.adam(**args) is False
        results.append(ps)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert not torch.equal(results[0][0], params[0])


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(grads=array.array("q", [1])), "grads has 1 entries, expected"),
        (dict(param_dtype=7), "unknown dtype code 7"),
        (dict(steps=[0] * len(SIZES)), r"steps\[0\] must be >= 1"),
        (dict(grad_divisor=0.0), "grad_divisor must be a positive"),
        (dict(masters=array.array("q", [0] * len(SIZES))), "masters are only for float16/bfloat16"),
        (dict(sizes=array.array("q", [-1, *SIZES[1:]])), r"sizes\[0\] is negative"),
        (dict(exp_avgs=array.array("q", [0] * len(SIZES))), r"exp_avgs\[\d+\] is a null pointer"),
        (dict(params=array.array("i", [0] * len(SIZES))), "expected a 1-D contiguous int64 buffer"),
        (dict(params="not a list"), "expected a list of ints"),
    ],
    ids=[
        "length",
        "dtype-code",
        "step-zero",
        "divisor",
        "masters-fp32",
        "negative-size",
        "null",
        "int32-buffer",
        "str",
    ],
)
def test_kernel_argument_errors(override, match):
    params, grads = make(torch.float32), make(torch.float32)
    m, v = [torch.zeros(p.numel()) for p in params], [torch.zeros(p.numel()) for p in params]
    before = [p.clone() for p in params]
    with pytest.raises((ValueError, TypeError), match=match):
        cpu.adam(**{**_adam_args(params, grads, m, v), **override})
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
