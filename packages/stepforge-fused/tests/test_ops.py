# SPDX-License-Identifier: Apache-2.0
"""The kernels as torch operators (``torch.ops.stepforge_fused``) on the CPU: schemas that declare every
mutation, ``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT dispatch), the eager
optimizers' bits, skip semantics, LAMB's two phases, and argument errors raised eagerly and while tracing."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch._dynamo
from torch.library import opcheck

import stepforge.fused as sf
from stepforge.fused import ops
from stepforge.testing.compiled import same_bits

OPS = torch.ops.stepforge_fused
SHAPES = [(5, 7), (13,), (2, 3, 4)]
HP = (0.9, 0.999, 1e-8, 0.01)  # beta1, beta2, eps, weight_decay


def tensors(dtype=torch.float32, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def zeros_like(ts):
    return [torch.zeros(t.shape) for t in ts]


def adam_args(pdtype=torch.float32, gdtype=None, masters=False, check=False, **kw):
    params, grads = tensors(pdtype), tensors(gdtype or pdtype, seed=1)
    m, v = tensors(seed=2), [t.abs() for t in tensors(seed=3)]
    w = [p.float() for p in params] if masters else []
    steps = torch.arange(len(params), dtype=torch.float32)
    flag = torch.zeros(1) if check else None
    lr_t, div_t = kw.get("lr_tensor"), kw.get("divisor_tensor")
    return (
        params,
        grads,
        m,
        v,
        w,
        steps,
        1e-3,
        lr_t,
        *HP,
        True,
        True,
        kw.get("divisor", 1.0),
        div_t,
        flag,
        check,
        False,
        0,
    )


def sgd_args(momentum=0.9, first=True, check=False):
    params, grads = tensors(), tensors(seed=1)
    bufs = tensors(seed=2) if momentum else []
    first_run = torch.tensor([1, 0, 1]) if first and momentum else None
    return (
        params,
        grads,
        bufs,
        [],
        first_run,
        0.1,
        None,
        momentum,
        0.1,
        1e-4,
        False,
        False,
        1.0,
        None,
        torch.zeros(1) if check else None,
        check,
        False,
        0,
    )


def lamb_args(masters=False):
    params = tensors(torch.bfloat16 if masters else torch.float32)
    grads, m, v = tensors(seed=1), tensors(seed=2), [t.abs() for t in tensors(seed=3)]
    w = [p.float() for p in params] if masters else []
    steps = torch.full((len(params),), 3.0)
    return (
        params,
        grads,
        m,
        v,
        w,
        steps,
        1e-3,
        torch.tensor(2e-3),
        *HP,
        True,
        True,
        True,
        False,
        0.01,
        10.0,
        2.0,
        None,
        torch.zeros(1),
        True,
        False,
        0,
    )


def test_every_kernel_is_an_operator_whose_schema_declares_what_it_mutates():
    """The schema of each operator marks exactly the arguments the kernel writes (``Tensor(a!)``; gradients are
    read only) and the updates return nothing."""
    assert ops.available(), ops.unavailable_reason()
    expected = {
        "adam_": {"params", "exp_avgs", "exp_avg_sqs", "masters", "steps", "found_inf"},
        "sgd_": {"params", "momentum_buffers", "masters", "first_run", "found_inf"},
        "lamb_": {"params", "exp_avgs", "exp_avg_sqs", "masters", "steps", "found_inf"},
        "lamb_moments_": {"exp_avgs", "exp_avg_sqs", "found_inf"},
        "lamb_apply_": {"params", "masters", "steps"},
        "l2norm": set(),
        "scale_": {"dst", "found_inf"},
    }
    assert set(ops.OPERATORS) == set(expected)
    for name, mutated in expected.items():
        schema = getattr(OPS, name).default._schema
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == mutated, name
        returns = [str(r.type) for r in schema.returns]
        assert returns == {"l2norm": ["Tensor", "Tensor"], "lamb_moments_": ["Tensor"]}.get(name, []), name
    assert "Tensor(a!)[] params" in str(OPS.adam_.default._schema)


OPCHECK_CASES = {
    "adam fp32": (OPS.adam_, lambda: adam_args()),
    "adam bf16 masters, tensor lr and divisor, check": (
        OPS.adam_,
        lambda: adam_args(
            torch.bfloat16,
            masters=True,
            check=True,
            lr_tensor=torch.tensor(2e-3),
            divisor=2.0,
            divisor_tensor=torch.tensor(4.0),
        ),
    ),
    "adam fp16 params, fp32 grads": (OPS.adam_, lambda: adam_args(torch.float16, torch.float32)),
    "sgd momentum, first run": (OPS.sgd_, lambda: sgd_args()),
    "sgd plain, check": (OPS.sgd_, lambda: sgd_args(momentum=0.0, check=True)),
    "lamb": (OPS.lamb_, lambda: lamb_args()),
    "lamb bf16 masters": (OPS.lamb_, lambda: lamb_args(masters=True)),
    "lamb_moments": (
        OPS.lamb_moments_,
        lambda: (*lamb_args()[:6], *HP, True, True, True, False, 1.0, None, torch.zeros(1), True),
    ),
    "lamb_apply": (
        OPS.lamb_apply_,
        lambda: (
            tensors(),
            tensors(seed=2),
            [t.abs() for t in tensors(seed=3)],
            [],
            torch.ones(3),
            torch.rand(6, dtype=torch.float64) + 0.5,
            1e-3,
            None,
            *HP,
            True,
            True,
            True,
            False,
            0.0,
            math.inf,
            None,
            False,
            0,
        ),
    ),
    "l2norm": (OPS.l2norm, lambda: (tensors(), True)),
    "l2norm bf16": (OPS.l2norm, lambda: (tensors(torch.bfloat16), False)),
    "scale": (OPS.scale_, lambda: (tensors(), zeros_like(tensors()), 0.5, torch.zeros(1))),
    "scale to bf16": (OPS.scale_, lambda: (tensors(), tensors(torch.bfloat16, seed=4), 0.25, None)),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    """torch.library.opcheck: schema (declared mutations only), fake tensors, autograd registration, AOT
    dispatch with dynamic shapes."""
    op, args = OPCHECK_CASES[case]
    results = opcheck(op.default, args())
    assert set(results.values()) == {"SUCCESS"}, results


def test_adam_operator_gives_the_eager_optimizers_bits():
    """adam_ on bf16 params with fp32 masters, a loss-scale divisor and a tensor lr, three calls, equals
    FusedAdam(master_weights=True).step(div_scale=...) bit for bit, steps included."""
    params = [torch.nn.Parameter(t) for t in tensors(torch.bfloat16)]
    opt = sf.FusedAdam(
        params, lr=torch.tensor(2e-3), weight_decay=0.01, master_weights=True, skip_nonfinite=False
    )
    p2 = [p.detach().clone() for p in params]
    m, v, w = zeros_like(p2), zeros_like(p2), [p.float() for p in p2]
    steps = torch.zeros(len(p2))
    for i in range(3):
        grads = tensors(torch.bfloat16, seed=10 + i)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step(div_scale=8.0)
        OPS.adam_(
            p2,
            grads,
            m,
            v,
            w,
            steps,
            0.0,
            torch.tensor(2e-3),
            *HP,
            True,
            True,
            8.0,
            None,
            None,
            False,
            False,
            0,
        )
    for p, q, mi, vi, wi, si in zip(params, p2, m, v, w, steps, strict=True):
        st = opt.state[p]
        assert same_bits(p.detach(), q) and same_bits(st["master_param"], wi)
        assert same_bits(st["exp_avg"], mi) and same_bits(st["exp_avg_sq"], vi)
        assert float(st["step"]) == float(si) == 3.0


def test_sgd_operator_first_run_flags_give_the_eager_optimizers_bits():
    """sgd_ with first_run flags initialises those buffers with the gradient (torch's first step), clears the
    flags, and three calls equal FusedSGD(dampening=0.1) bit for bit."""
    params = [torch.nn.Parameter(t) for t in tensors()]
    opt = sf.FusedSGD(params, lr=0.1, momentum=0.9, dampening=0.1, nesterov=False, weight_decay=1e-4)
    p2 = [p.detach().clone() for p in params]
    bufs, first = zeros_like(p2), torch.ones(3, dtype=torch.int64)
    for i in range(3):
        grads = tensors(seed=10 + i)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        OPS.sgd_(
            p2,
            grads,
            bufs,
            [],
            first,
            0.1,
            None,
            0.9,
            0.1,
            1e-4,
            False,
            False,
            1.0,
            None,
            None,
            False,
            False,
            0,
        )
        assert first.tolist() == [0, 0, 0]
    for p, q, b in zip(params, p2, bufs, strict=True):
        assert same_bits(p.detach(), q) and same_bits(opt.state[p]["momentum_buffer"], b)


def test_raised_flag_skips_and_the_finite_check_raises_it():
    """found_inf set on entry: nothing is written and the steps stay; check_finite with an inf gradient: the flag
    is raised, nothing else is written, the steps stay."""
    args = list(adam_args(check=True))
    before = [[t.clone() for t in args[i]] for i in range(6)]
    args[16].fill_(1.0)
    OPS.adam_(*args)
    for i in range(6):
        assert all(same_bits(a, b) for a, b in zip(before[i], args[i], strict=True)), i
    args[16].zero_()
    args[1][1][3] = float("inf")
    before = [[t.clone() for t in args[i]] for i in range(6)]
    OPS.adam_(*args)
    assert float(args[16]) == 1.0
    for i in range(6):  # the gradients too: no operator writes them
        assert all(same_bits(a, b) for a, b in zip(before[i], args[i], strict=True)), i
    args[1][1][3] = 0.0
    args[16].zero_()
    OPS.adam_(*args)
    assert [float(s) for s in args[5]] == [1.0, 2.0, 3.0]
    assert not same_bits(before[0][0], args[0][0])


def test_lamb_two_phases_equal_the_single_call():
    """lamb_moments_ then lamb_apply_ with the sums unchanged give lamb_'s bits (bf16 params, fp32 masters);
    the moments phase leaves params and steps alone."""
    one = lamb_args(masters=True)
    two = lamb_args(masters=True)
    OPS.lamb_(*one)
    params, grads, m, v, w, steps = two[:6]
    p_before = [p.clone() for p in params]
    norms = OPS.lamb_moments_(
        params, grads, m, v, w, steps, *HP, True, True, True, False, 2.0, None, two[20], True
    )
    assert norms.dtype == torch.float64 and norms.shape == (6,)
    assert all(same_bits(a, b) for a, b in zip(p_before, params, strict=True))
    assert [float(s) for s in steps] == [3.0, 3.0, 3.0]
    OPS.lamb_apply_(
        params,
        m,
        v,
        w,
        steps,
        norms,
        1e-3,
        torch.tensor(2e-3),
        *HP,
        True,
        True,
        True,
        False,
        0.01,
        10.0,
        two[20],
        False,
        0,
    )
    for i in range(6):
        assert all(same_bits(a, b) for a, b in zip(one[i], two[i], strict=True)), i


def test_l2norm_and_scale_values():
    """l2norm: the float64 global norm and float32 per-tensor norms of the inputs; scale_: dst = src * s in the
    destination dtype, and an inf input raises the flag."""
    xs = tensors()
    norm, each = OPS.l2norm(xs, True)
    expected = torch.cat([x.double().reshape(-1) for x in xs]).norm()
    assert norm.dtype == torch.float64 and norm.shape == ()
    assert float(norm) == pytest.approx(float(expected), rel=1e-12)
    torch.testing.assert_close(each, torch.stack([x.norm() for x in xs]))
    assert OPS.l2norm(xs, False)[1].shape == (0,)
    dst, flag = tensors(torch.bfloat16, seed=5), torch.zeros(1)
    OPS.scale_(xs, dst, 0.5, flag)
    assert all(torch.equal(d, (x * 0.5).to(torch.bfloat16)) for d, x in zip(dst, xs, strict=True))
    assert float(flag) == 0.0
    xs[2][0, 0, 0] = float("inf")
    OPS.scale_(xs, dst, 0.5, flag)
    assert float(flag) == 1.0


BAD_CALLS = {
    "lengths": (lambda a: a[2].pop(), r"exp_avgs has 2 tensors, expected 3"),
    "state dtype": (
        lambda a: a[3].__setitem__(0, a[3][0].half()),
        r"exp_avg_sqs\[0\] has dtype torch.float16",
    ),
    "grad dtypes mixed": (
        lambda a: a[1].__setitem__(1, a[1][1].double()),
        r"grads\[1\] has dtype torch.float64",
    ),
    "sizes": (
        lambda a: a[2].__setitem__(2, torch.zeros(3)),
        r"exp_avgs\[2\] has 3 elements but its parameter 24",
    ),
    "masters for fp32": (
        lambda a: a[4].extend(t.clone() for t in a[0]),
        "masters were given for float32 params",
    ),
    "non-contiguous": (lambda a: a[0].__setitem__(0, a[0][0].t()), r"params\[0\] is not contiguous"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_fail_clearly_eagerly_and_while_tracing(case):
    """A malformed call names the operator, the argument and the fix, in eager mode and from the fake
    implementation while torch.compile traces (the same check runs in both)."""
    mutate, match = BAD_CALLS[case]
    args = list(adam_args())
    mutate(args)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        OPS.adam_(*args)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(lambda: OPS.adam_(*args), fullgraph=True, backend="aot_eager")()


def test_importing_the_package_registers_the_operators_without_importing_dynamo():
    """Registering the operators costs milliseconds: `import stepforge.fused` defines them all and leaves
    torch._dynamo (about a second to import) unimported until something compiles."""
    code = (
        "import sys, torch, stepforge.fused; "
        "assert stepforge.fused.ops.available(), stepforge.fused.ops.unavailable_reason(); "
        "assert all(hasattr(torch.ops.stepforge_fused, n) for n in stepforge.fused.ops.OPERATORS); "
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_stochastic_rounding_is_refused_on_cpu():
    """Stochastic rounding lives in the CUDA kernels: a CPU call asking for it fails naming the fix."""
    args = list(adam_args(torch.bfloat16, masters=True))
    args[18] = True
    with pytest.raises(ValueError, match="stochastic rounding is done by the CUDA kernels only"):
        OPS.adam_(*args)
