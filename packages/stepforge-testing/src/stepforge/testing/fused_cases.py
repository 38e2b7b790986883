# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the stepforge-fused test suites: kernel argument arrays, raw bits, and the
update-relative closeness check that a do-nothing optimizer cannot pass.

The check (used for low-precision parameters, whose rounding is wider than a few steps' update)::

    ||ours - ref|| <= REL * ||ref - start|| + ||ulp(ref)||          (per tensor, 2-norm)

``ulp(ref)`` is one unit in the last place of each reference element (``torch.finfo(dtype).eps * |ref|``, at
least the smallest normal): one rounding per element plus a quarter of the update. A do-nothing optimizer has
error ``||ref - start||`` and fails whenever the update is larger than about 1.3 ulps in norm.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = [
    "DTYPE_CODES",
    "DTYPE_COMBOS",
    "F32_TOL",
    "KERNEL_DTYPES",
    "KERNEL_SIZES",
    "MAX_ULPS_AWAY",
    "REL",
    "assert_same_in_dtype",
    "check_kernel_params",
    "check_update_close",
    "combo_id",
    "float_bits",
    "kernel_state",
    "pointer_array",
    "random_tensors",
    "raw_bytes",
    "sizes_array",
    "ulp_norm",
]

#: share of the update the error may reach in :func:`check_update_close`
REL = 0.25
#: dtype codes of the kernel contract (packages/stepforge-fused/csrc/README.md), both modules
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KERNEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: empty, 1 element, odd sizes around the SIMD widths (8/16) and the block (512), one above the parallel cutoff
KERNEL_SIZES = [0, 1, 7, 15, 16, 17, 33, 511, 513, 1001, 40_005]
#: float32 results: a few ulps of op-order difference
F32_TOL: dict[str, Any] = dict(rtol=1e-5, atol=1e-6)
#: 16-bit results: rounding the same float32 value, which may differ in its last bits
MAX_ULPS_AWAY = 1
#: (param dtype, grad dtype, master weights) of every kernel path
DTYPE_COMBOS = [
    (p, g, m)
    for p in KERNEL_DTYPES
    for g in KERNEL_DTYPES
    for m in ((False, True) if p != torch.float32 else (False,))
]


def combo_id(combo: tuple[torch.dtype, torch.dtype, bool]) -> str:
    """pytest id of a :data:`DTYPE_COMBOS` entry, e.g. ``pbfloat16-gfloat32-master``."""
    p, g, m = combo
    return f"p{str(p)[6:]}-g{str(g)[6:]}{'-master' if m else ''}"


def random_tensors(dtype: torch.dtype, sizes: Sequence[int] = tuple(KERNEL_SIZES)) -> list[torch.Tensor]:
    """1-D ``randn`` tensors of the given sizes in ``dtype``."""
    return [torch.randn(n).to(dtype) for n in sizes]


def kernel_state(
    params: Sequence[torch.Tensor], master: bool
) -> tuple[list[torch.Tensor] | None, list[torch.Tensor], list[torch.Tensor]]:
    """``(masters or None, m, v)`` for a kernel call: float32 masters copied from ``params``, zero moments."""
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


def check_kernel_params(
    params: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor] | None,
    ref_p: Sequence[torch.Tensor],
    before: Sequence[torch.Tensor],
    pdt: torch.dtype,
    master: bool,
) -> None:
    """Params (or masters) after a kernel step equal the reference's (float32: :data:`F32_TOL`; 16-bit: one ulp)
    and moved; with masters the 16-bit params are exactly the rounded masters."""
    for i, p in enumerate(params):
        if master:
            assert masters is not None
            torch.testing.assert_close(masters[i], ref_p[i], **F32_TOL)
            assert torch.equal(p, masters[i].to(pdt)), "the low-precision copy must be the rounded master"
        elif pdt == torch.float32:
            torch.testing.assert_close(p, ref_p[i], **F32_TOL)
        else:
            assert_same_in_dtype(p, ref_p[i], before[i])
        if p.numel() >= 100:
            moved = (masters[i] if master and masters is not None else p.float()) - before[i].float()
            assert float(moved.abs().mean()) > 1e-3, "the kernel did not move the params"


def pointer_array(tensors: Iterable[torch.Tensor] | None) -> array.array[int] | None:
    """``array('q')`` of the tensors' ``data_ptr()`` (the kernels' pointer-list argument); None stays None."""
    if tensors is None:
        return None
    return array.array("q", [t.data_ptr() for t in tensors])


def sizes_array(tensors: Iterable[torch.Tensor]) -> array.array[int]:
    """``array('q')`` of the tensors' element counts (the kernels' sizes argument)."""
    return array.array("q", [t.numel() for t in tensors])


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a float tensor as the same-width integer tensor (float32 -> int32, 16-bit -> int16)."""
    width = {4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(width)


def raw_bytes(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Raw bytes of each tensor, whatever its dtype (NaN payloads included), as uint8 copies."""
    return [t.detach().contiguous().view(torch.uint8).clone() for t in tensors]


def ulp_norm(ref: torch.Tensor) -> float:
    """2-norm of one unit in the last place of every element of ``ref`` (in ``ref``'s dtype)."""
    finfo = torch.finfo(ref.dtype)
    return float((ref.float().abs() * finfo.eps).clamp_min(finfo.tiny).norm())


def check_update_close(
    got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], start: Sequence[torch.Tensor], what: str = ""
) -> None:
    """Per tensor: ``||got - want||`` is at most a quarter of the update ``||want - start||`` plus one ulp per
    element (in norm). Raises ``AssertionError`` (message containing ``update``) otherwise."""
    for i, (a, b, s) in enumerate(zip(got, want, start, strict=True)):
        a, b, s = a.detach(), b.detach(), s.detach()
        assert a.dtype == b.dtype == s.dtype
        err = float((a.float() - b.float()).norm())
        upd = float((b.float() - s.float()).norm())
        bound = REL * upd + ulp_norm(b)
        assert err <= bound, f"{what} tensor {i}: |ours-ref|={err:.3g} > {bound:.3g} (|update|={upd:.3g})"
