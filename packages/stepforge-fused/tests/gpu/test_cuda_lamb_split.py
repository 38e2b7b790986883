# SPDX-License-Identifier: Apache-2.0
"""The CUDA ``lamb`` split (``norms_out_ptr`` / ``norms_in_ptr``, device float64 buffers), as on the CPU.

References: the single ``lamb`` call (the split with unchanged sums must give its bits), float64 torch sums of
``p^2``, and ``trust_clip=(1, 1)`` for sums that force a ratio of 1. Needs a device (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SIZES = [1, 7, 17, 513, 16385, 40_001]  # across the 16384-element chunk boundary


def _case(seed):
    gen = torch.Generator().manual_seed(seed)
    out = [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(3)]
    out.append([torch.rand(n, generator=gen) * 0.1 for n in SIZES])
    return [[t.cuda() for t in ts] for ts in out]  # params, grads, m, v


def _lamb(cuda_mod, case, trust=(0.0, float("inf")), **kw):
    p, g, m, v = case
    return cuda_mod.lamb(
        [t.data_ptr() for t in p], [t.data_ptr() for t in g], [t.data_ptr() for t in m],
        [t.data_ptr() for t in v], None, SIZES, [3] * len(SIZES), 0, 0, 1e-2, 0.9, 0.999, 1e-6, 0.01, True, True,
        True, False, trust[0], trust[1], 2.0, 0, False, torch.cuda.current_stream().cuda_stream, **kw,
    )  # fmt: skip


def _same(a, b):
    return all(torch.equal(s, t) for x, y in zip(a, b, strict=True) for s, t in zip(x, y, strict=True))


def test_split_with_unchanged_sums_gives_the_single_call_bits(cuda_mod):
    one = _case(0)
    two = [[t.clone() for t in ts] for ts in one]
    before = [t.clone() for t in two[0]]
    _lamb(cuda_mod, one)
    norms = torch.full((2 * len(SIZES),), float("nan"), dtype=torch.float64, device="cuda")
    _lamb(cuda_mod, two, norms_out_ptr=norms.data_ptr())
    torch.cuda.synchronize()
    assert _same([two[0]], [before])  # the norms pass leaves the params alone
    want = torch.tensor([t.double().pow(2).sum().item() for t in before], dtype=torch.float64, device="cuda")
    torch.testing.assert_close(norms[: len(SIZES)], want, rtol=1e-6, atol=0.0)  # float32 chunk partials
    _lamb(cuda_mod, two, norms_in_ptr=norms.data_ptr())
    torch.cuda.synchronize()
    assert _same(two, one)


def test_apply_pass_takes_the_ratio_from_the_given_sums(cuda_mod):
    ref = _case(1)
    got = [[t.clone() for t in ts] for ts in ref]
    _lamb(cuda_mod, ref, trust=(1.0, 1.0))
    norms = torch.zeros(2 * len(SIZES), dtype=torch.float64, device="cuda")
    _lamb(cuda_mod, got, norms_out_ptr=norms.data_ptr())
    norms[len(SIZES) :] = norms[: len(SIZES)]  # ||u|| := ||p||: a ratio of exactly 1
    _lamb(cuda_mod, got, norms_in_ptr=norms.data_ptr())
    torch.cuda.synchronize()
    assert _same(got, ref)


def test_norms_out_and_in_together_are_refused(cuda_mod):
    norms = torch.zeros(2 * len(SIZES), dtype=torch.float64, device="cuda")
    with pytest.raises(ValueError, match="norms_out_ptr .* or norms_in_ptr"):
        _lamb(cuda_mod, _case(2), norms_out_ptr=norms.data_ptr(), norms_in_ptr=norms.data_ptr())
