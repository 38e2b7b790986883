# SPDX-License-Identifier: Apache-2.0
"""Many small tensors and large state: one kernel call over a long list, and huge-page state.

The 20 000 x 1k benchmark case in a test: on every ISA path (the ``isa`` fixture) FusedSGD stays bit-identical
to torch's for-loop SGD and CPUAdam to torch's fused AdamW over a list of many tensors, with sizes around the
SIMD widths, the conversion blocks (512) and the parallel cut-off (2**15), next tensors smaller and larger than
the current one, and enough elements that thread chunks start and end inside tensors. Large CPU state is
allocated on memory advised for transparent huge pages (``_huge_pages``), with values unchanged.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from stepforge.fused import CPUAdam, FusedSGD, _backend
from stepforge.fused._huge_pages import MIN_HUGE_BYTES, float32_copy, float32_zeros_like

# odd sizes, block and vector edges, tensors on both sides of the parallel cut-off, tiny ones after big ones
SIZES = [1000] * 40 + [255, 256, 257, 1, 65_536, 3, 65_537, 4099, 17, 70_001, 512, 1000]
SGD_VARIANTS = [
    dict(momentum=0.0, weight_decay=1e-2),
    dict(momentum=0.9, weight_decay=1e-2),
    dict(momentum=0.9, dampening=0.3),
    dict(momentum=0.8, nesterov=True, weight_decay=1e-2),
]
SGD_IDS = ["plain-wd", "momentum-wd", "dampening", "nesterov-wd"]
ADAM_HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _params(dtype: torch.dtype = torch.float32, seed: int = 3) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]


def _grads(params: list[torch.nn.Parameter], gen: torch.Generator) -> list[torch.Tensor]:
    return [(torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype) for p in params]


@pytest.mark.parametrize("hp", SGD_VARIANTS, ids=SGD_IDS)
def test_sgd_on_many_small_tensors_equals_torch_for_loop_bit_for_bit(isa, hp):
    ours = _params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedSGD(ours, lr=0.05, **hp)
    ref_opt = torch.optim.SGD(ref, lr=0.05, foreach=False, **hp)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        for p, q, g in zip(ours, ref, _grads(ours, gen), strict=True):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(p.detach(), q.detach()), f"param #{i} ({p.numel()} elements) differs"
        if hp["momentum"]:
            assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]), i


def test_sgd_master_weights_on_many_small_tensors_equal_float32_for_loop(isa):
    hp = dict(momentum=0.9, weight_decay=1e-2)
    ours = _params(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = FusedSGD(ours, lr=0.05, master_weights=True, **hp)
    ref_opt = torch.optim.SGD(ref, lr=0.05, foreach=False, **hp)
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        for p, q, g in zip(ours, ref, _grads(ours, gen), strict=True):
            p.grad, q.grad = g, g.float()
        opt.step()
        ref_opt.step()
    for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(opt.state[p]["master_param"], q.detach()), f"master #{i} differs"
        assert torch.equal(p.detach(), q.detach().to(torch.bfloat16)), f"param #{i} differs"


def test_cpu_adam_on_many_small_tensors_equals_torch_fused_adamw_bit_for_bit(isa):
    ours = _params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = CPUAdam(ours, adamw_mode=True, **ADAM_HP)
    ref_opt = torch.optim.AdamW(ref, fused=True, **ADAM_HP)
    gen = torch.Generator().manual_seed(13)
    for _ in range(3):
        for p, q, g in zip(ours, ref, _grads(ours, gen), strict=True):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(p.detach(), q.detach()), f"param #{i} ({p.numel()} elements) differs"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], ref_opt.state[q][key]), f"{key} #{i} differs"


def test_cpu_adam_master_weights_on_many_small_tensors_equal_torch_fused_on_masters(isa):
    ours = _params(torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = CPUAdam(ours, adamw_mode=True, master_weights=True, **ADAM_HP)
    ref_opt = torch.optim.AdamW(masters, fused=True, **ADAM_HP)
    gen = torch.Generator().manual_seed(14)
    for _ in range(3):
        for p, m, g in zip(ours, masters, _grads(ours, gen), strict=True):
            p.grad, m.grad = g, g.float()
        opt.step()
        ref_opt.step()
    for i, (p, m) in enumerate(zip(ours, masters, strict=True)):
        assert torch.equal(opt.state[p]["master_param"], m.detach()), f"master #{i} differs"
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), f"param #{i} differs"


# ---- huge-page state --------------------------------------------------------------------------------------
def test_advise_huge_pages_covers_exactly_the_aligned_interior():
    mod = _backend.cpu_module()
    huge = 1 << 21
    buf = (ctypes.c_char * (5 * huge)).from_buffer(bytearray(5 * huge))
    base = ctypes.addressof(buf)
    start = -(-(base + 100) // huge) * huge
    end = (base + 100 + 4 * huge + 12345) // huge * huge
    advised = mod.advise_huge_pages(base + 100, 4 * huge + 12345)
    if os.uname().sysname != "Linux":
        assert advised == 0
    else:
        assert advised == end - start
    assert mod.advise_huge_pages(0, 1 << 30) == 0
    assert mod.advise_huge_pages(base, huge // 2) == 0  # no whole huge page inside


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_page_state_helpers_match_torch_allocations(dtype, monkeypatch):
    n = MIN_HUGE_BYTES // 4 + 1001
    p = torch.nn.Parameter(torch.randn(n).to(dtype).view(-1, 1))
    for env in ("1", "0"):
        monkeypatch.setenv("STEPFORGE_STATE_HUGE_PAGES", env)
        z = float32_zeros_like(p)
        assert z.dtype == torch.float32 and z.shape == p.shape and z.is_contiguous() and not z.requires_grad
        assert not z.any()
        c = float32_copy(p)
        assert c.dtype == torch.float32 and c.shape == p.shape and not c.requires_grad
        assert torch.equal(c, p.detach().float())
        assert c.data_ptr() != p.data_ptr()


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def _thp_eligible(ptr: int) -> bool | None:
    """THPeligible of the mapping holding ``ptr`` in /proc/self/smaps (None: not reported)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_large_cpu_state_is_eligible_for_transparent_huge_pages(monkeypatch):
    mode = _thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode or 'not available'} on this machine")
    monkeypatch.delenv("STEPFORGE_STATE_HUGE_PAGES", raising=False)
    n = 16 << 20  # 64 MiB of float32 state: several whole huge pages whatever the alignment
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones(n)
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    assert torch.equal(buf, torch.ones(n))  # the first step copies the grad into the (zeroed) buffer
    middle = buf.data_ptr() + (n * 4) // 2
    eligible = _thp_eligible(middle)
    if eligible is None:
        pytest.skip("this kernel's /proc/self/smaps has no THPeligible field")
    assert eligible, "the momentum buffer's mapping was not advised for huge pages"
