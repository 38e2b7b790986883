# SPDX-License-Identifier: Apache-2.0
"""Helpers of the stepforge-fused CUDA kernel tests (``tests/gpu/test_cuda_kernels*.py``): dtype codes, ragged
shapes, per-dtype tolerances, pointer lists and one Adam launch with the contract's argument order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CODES", "SHAPES", "TOL", "adam_call", "clone_all", "ctx", "make", "ptrs", "sizes"]

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Ragged on purpose: empty, tails that are not a multiple of 4, exactly one chunk (16384), one chunk + 1.
SHAPES = [(0,), (1,), (3,), (7, 5), (4096,), (16384,), (16385,), (3, 33333)]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def ptrs(ts: Sequence[torch.Tensor]) -> list[int]:
    """The tensors' ``data_ptr()`` as a list (the CUDA kernels' pointer-list argument)."""
    return [t.data_ptr() for t in ts]


def sizes(ts: Sequence[torch.Tensor]) -> list[int]:
    """The tensors' element counts."""
    return [t.numel() for t in ts]


def ctx() -> int:
    """The current CUDA stream handle (the kernels' ``ctx``)."""
    return torch.cuda.current_stream().cuda_stream


def make(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, *, scale: float = 1.0, device: str = "cuda"
) -> list[torch.Tensor]:
    """``randn * scale`` tensors of the given shapes, in ``dtype`` on ``device``."""
    return [(torch.randn(s, device=device) * scale).to(dtype) for s in shapes]


def clone_all(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the tensors."""
    return [t.clone() for t in ts]


def adam_call(
    mod: Any,
    p: Sequence[torch.Tensor],
    g: Sequence[torch.Tensor],
    m: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    steps: Any,
    *,
    masters: Sequence[torch.Tensor] | None = None,
    lr: float = 1e-3,
    wd: float = 0.01,
    adamw: bool = True,
    div: float = 1.0,
    found_inf: Any = None,
    check_finite: bool = False,
    **kw: Any,
) -> Any:
    """One ``mod.adam`` launch on lists ``p, g, m, v`` (betas 0.9/0.999, eps 1e-8, bias correction on)."""
    pdt = p[0].dtype if p else torch.float32
    gdt = g[0].dtype if g else torch.float32
    return mod.adam(
        ptrs(p),
        ptrs(g),
        ptrs(m),
        ptrs(v),
        None if masters is None else ptrs(masters),
        sizes(p),
        steps,
        CODES[pdt],
        CODES[gdt],
        lr,
        0.9,
        0.999,
        1e-8,
        wd,
        adamw,
        True,
        div,
        0 if found_inf is None else found_inf.data_ptr(),
        check_finite,
        ctx(),
        **kw,
    )
