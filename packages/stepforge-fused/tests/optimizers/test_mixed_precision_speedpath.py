# SPDX-License-Identifier: Apache-2.0
"""CPUAdam bf16 params + fp32 masters on every ISA: bit-identical to torch's fp32 fused AdamW on the masters.

Covers the one-pass master kernel with streamed bf16 stores: tensors large enough for several threads and
blocks, sizes that are not multiples of the vector width, params whose storage starts off a 64-byte boundary,
and NaN / inf master values (inf stays inf; every NaN becomes the canonical bf16 NaN 0x7FC0).
"""

from __future__ import annotations

import torch

from stepforge.fused import CPUAdam
from stepforge.testing.fused_cases import float_bits as _bits

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _params() -> list[torch.nn.Parameter]:
    sizes = [70_001, 1_029, 40_000, 33]
    out = []
    for k, n in enumerate(sizes):
        base = torch.randn(n + k * 3) * 3.0
        if k == 0:
            base[5] = float("nan")
            base[40_000] = float("inf")
            base[60_000] = float("-inf")
        # A contiguous slice at an odd element offset: storage starts 2-6 bytes off a 64-byte boundary.
        out.append(torch.nn.Parameter(base.to(torch.bfloat16)[k * 3 :]))
    return out


def test_master_step_bit_identical_to_torch_fused_adamw_on_masters(isa):
    ours = _params()
    masters = [p.detach().float().clone().requires_grad_(True) for p in ours]
    opt = CPUAdam(ours, adamw_mode=True, master_weights=True, skip_nonfinite=False, **HP)
    ref = torch.optim.AdamW(masters, fused=True, **HP)
    for _ in range(3):
        for p, m in zip(ours, masters, strict=True):
            g = (torch.randn(p.shape) * 1e-1).to(torch.bfloat16)
            p.grad = g
            m.grad = g.float()
        opt.step()
        ref.step()
    for p, m in zip(ours, masters, strict=True):
        master = opt.state[p]["master_param"]
        assert torch.equal(master.view(torch.int32), m.detach().view(torch.int32))
        # Kernel contract (csrc/include/stepforge/common.h): round to nearest even, every NaN -> 0x7FC0.
        expected = _bits(m.detach().to(torch.bfloat16)).clone()
        expected[m.detach().isnan()] = 0x7FC0
        assert torch.equal(_bits(p), expected)
