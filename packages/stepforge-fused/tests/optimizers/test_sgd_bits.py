# SPDX-License-Identifier: Apache-2.0
"""FusedSGD is bit-identical to torch.optim.SGD wherever it was before the kernel was made fast.

Pinned on every ISA path (the ``isa`` fixture), with tensors above the parallel cut-off so thread chunks split
them, and with sizes that leave every SIMD tail:

- float32, every variant (momentum, dampening, nesterov, weight decay): params and ``momentum_buffer`` equal
  torch's for-loop SGD (``foreach=False``: ``buf.mul_(m).add_(g, alpha=1-dampening)``, our operation order);
- float32 without momentum: equal to ``SGD(fused=True)`` as well, at every size;
- float32 with momentum: equal to ``SGD(fused=True)`` on sizes its vector body covers (multiples of 64). torch's
  scalar tail contracts ``buf*m + g*(1-dampening)`` into one fma, the for-loop does not, so one kernel cannot
  match both there; we follow the for-loop;
- bf16/fp16 params with fp32 master weights: the master equals torch's for-loop SGD run on float32 copies of the
  params with the grads converted to float32, and the param is that master rounded to the param dtype.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from stepforge.fused import FusedSGD

ODD_SIZES = [1, 7, 17, 33, 1000, 4099, 70_001]  # 70 001 > 2**15: split across thread chunks
BODY_SIZES = [64, 1024, 65_536, 131_072]
VARIANTS = [
    dict(momentum=0.0, weight_decay=0.0),
    dict(momentum=0.0, weight_decay=1e-2),
    dict(momentum=0.9, weight_decay=0.0),
    dict(momentum=0.9, weight_decay=1e-2),
    dict(momentum=0.9, dampening=0.3, weight_decay=1e-2),
    dict(momentum=0.8, nesterov=True, weight_decay=1e-2),
    dict(momentum=0.8, nesterov=True),
]
VARIANT_IDS = ["plain", "wd", "momentum", "momentum-wd", "dampening-wd", "nesterov-wd", "nesterov"]


def _run(sizes, hp, make_ref, dtype=torch.float32, master=False, steps=4):
    """Both optimizers from the same start with the same grads; returns (ours, ref, ours_opt, ref_opt)."""
    gen = torch.Generator().manual_seed(7)
    ours = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = FusedSGD(ours, lr=0.05, master_weights=master, **hp)
    ref_opt = make_ref(ref, dict(lr=0.05, **hp))
    for _ in range(steps):
        for p, q in zip(ours, ref, strict=True):
            g = torch.randn(p.shape, generator=gen).to(dtype)
            p.grad, q.grad = g, g.float()
        opt.step()
        ref_opt.step()
    return ours, ref, opt, ref_opt


def _assert_bits(ours, ref, opt, ref_opt, momentum):
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p.detach(), q.detach()), f"param of {p.numel()} elements differs"
        if momentum:
            assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])


def _for_loop(params, hp):
    return torch.optim.SGD(params, foreach=False, **hp)


def _fused(params, hp):
    return torch.optim.SGD(params, fused=True, **hp)


@pytest.mark.parametrize("hp", VARIANTS, ids=VARIANT_IDS)
def test_fp32_equals_torch_for_loop_sgd_bit_for_bit(isa, hp):
    ours, ref, opt, ref_opt = _run(ODD_SIZES, hp, _for_loop)
    _assert_bits(ours, ref, opt, ref_opt, hp["momentum"])


@pytest.mark.parametrize("hp", VARIANTS, ids=VARIANT_IDS)
def test_fp32_equals_torch_fused_sgd_bit_for_bit(isa, hp):
    sizes = BODY_SIZES if hp["momentum"] else ODD_SIZES
    ours, ref, opt, ref_opt = _run(sizes, hp, _fused)
    _assert_bits(ours, ref, opt, ref_opt, hp["momentum"])


@pytest.mark.parametrize(
    "dtype,hp",
    list(itertools.product((torch.bfloat16, torch.float16), VARIANTS[1:])),
    ids=[f"{d}-{v}" for d, v in itertools.product(("bf16", "fp16"), VARIANT_IDS[1:])],
)
def test_master_weights_equal_torch_sgd_on_float32_copies(isa, dtype, hp):
    ours, ref, opt, ref_opt = _run(ODD_SIZES, hp, _for_loop, dtype=dtype, master=True)
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(opt.state[p]["master_param"], q.detach())
        assert torch.equal(p.detach(), q.detach().to(dtype))
        if hp["momentum"]:
            assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
