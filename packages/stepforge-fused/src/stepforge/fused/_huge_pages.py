# SPDX-License-Identifier: Apache-2.0
"""Float32 optimizer state on transparent huge pages (CPU).

The kernels stream every state tensor once per step; on 4 KiB pages each 4 KiB of a stream costs a TLB miss,
which measurably slows a memory-bound step (torch's allocator avoids it only under ``THP_MEM_ALLOC_ENABLE=1``). So
large CPU state tensors are allocated untouched, advised for huge pages (``madvise(MADV_HUGEPAGE)``; a no-op where
refused) and only then filled. ``STEPFORGE_STATE_HUGE_PAGES=0`` allocates state like torch does (for an A/B).
"""

from __future__ import annotations

import os

import torch

from . import _backend
from ._distributed import is_dtensor

__all__ = ["MIN_HUGE_BYTES", "float32_copy", "float32_zeros_like"]

#: below this many bytes a tensor spans too few huge pages to matter (and glibc may serve it from its heap)
MIN_HUGE_BYTES = 4 << 20


def _huge_eligible(p: torch.Tensor) -> bool:
    return (
        p.device.type == "cpu"
        and not is_dtensor(p)
        and p.numel() * 4 >= MIN_HUGE_BYTES
        and os.environ.get("STEPFORGE_STATE_HUGE_PAGES", "1") != "0"
    )


def _advised_empty(p: torch.Tensor) -> torch.Tensor:
    out = torch.empty(p.shape, dtype=torch.float32)
    mod, _why = _backend._load("_cpu")
    if mod is not None:
        mod.advise_huge_pages(out.data_ptr(), out.numel() * 4)
    return out


def float32_zeros_like(p: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 zero tensor shaped like ``p`` on ``p``'s device (huge pages for large CPU ones)."""
    if not _huge_eligible(p):
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    return _advised_empty(p).zero_()


def float32_copy(p: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy of ``p`` (detached; huge pages for large CPU ones)."""
    if not _huge_eligible(p):
        return p.detach().to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    return _advised_empty(p).copy_(p.detach())
