# SPDX-License-Identifier: Apache-2.0
"""The `_cpu` kernels called directly (contract: csrc/README.md).

References: stepforge-testing's written-out optimizers run on the same values, rounding to the same storage
dtype every step (so a 16-bit result is compared with what the same step gives in that dtype, not with a
float32 run), and torch's own fused AdamW where the contract is bit identity. Every assertion also fails for a
kernel that does nothing: the updates are several ulps of the stored dtype.
"""

from __future__ import annotations

import array
import math

import pytest
import torch

from stepforge.fused import _backend
from stepforge.testing.reference import reference_adam_step, reference_lamb_step, reference_sgd_step

cpu = _backend.cpu_module()
CODE = _backend.DTYPE_CODES
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# empty, 1 element, odd sizes around the SIMD widths (8/16) and the block (512), one above the parallel cutoff
SIZES = [0, 1, 7, 15, 16, 17, 33, 511, 513, 1001, 40_005]
F32_TOL = dict(rtol=1e-5, atol=1e-6)  # float32 results: a few ulps of op-order difference
MAX_ULPS_AWAY = 1  # 16-bit results: rounding the same float32 value, which may differ in its last bits


def ptrs(tensors):
    return array.array("q", [t.data_ptr() for t in tensors])


def sizes_of(tensors):
    return array.array("q", [t.numel() for t in tensors])


def make(dtype, sizes=SIZES):
    return [torch.randn(n).to(dtype) for n in sizes]


COMBOS = [
    (p, g, m) for p in DTYPES for g in DTYPES for m in ((False, True) if p != torch.float32 else (False,))
]


def combo_id(c):
    p, g, m = c
    return f"p{str(p)[6:]}-g{str(g)[6:]}{'-master' if m else ''}"


def _state(params, master):
    masters = [p.float().clone() for p in params] if master else None
    return masters, [torch.zeros(p.numel()) for p in params], [torch.zeros(p.numel()) for p in params]


def assert_same_in_dtype(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> None:
    """16-bit results: at most one ulp from the reference, nearly all equal, and (almost) every element moved."""
    assert got.dtype == want.dtype and got.dtype in (torch.float16, torch.bfloat16)
    gi, wi = got.view(torch.int16).int(), want.view(torch.int16).int()
    same_sign = (gi < 0) == (wi < 0)
    close = (same_sign & ((gi - wi).abs() <= MAX_ULPS_AWAY)) | (got.float() - want.float()).abs().le(1e-7)
    assert bool(close.all()), f"{int((~close).sum())} elements more than one ulp away"
    if got.numel() >= 100:
        assert float(got.eq(want).float().mean()) > 0.97
        assert float(got.ne(before).float().mean()) > 0.5, "the kernel did not move the params"


def _check_params(params, masters, ref_p, before, pdt, master):
    for i, p in enumerate(params):
        if master:
            torch.testing.assert_close(masters[i], ref_p[i], **F32_TOL)
            assert torch.equal(p, masters[i].to(pdt)), "the low-precision copy must be the rounded master"
        elif pdt == torch.float32:
            torch.testing.assert_close(p, ref_p[i], **F32_TOL)
        else:
            assert_same_in_dtype(p, ref_p[i], before[i])
        if p.numel() >= 100:
            moved = (masters[i] if master else p.float()) - before[i].float()
            assert float(moved.abs().mean()) > 1e-3, "the kernel did not move the params"


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


def _bits(ts):
    """Raw bits of the tensors, whatever their dtype (NaN payloads included)."""
    return [t.contiguous().view(torch.uint8).clone() for t in ts]


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
