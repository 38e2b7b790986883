# SPDX-License-Identifier: Apache-2.0
"""How gradient buckets are laid out and sized, as pure functions of the pieces (no collective).

- :func:`write_rank_major` / :func:`write_own_row_last`: a gradient written into a bucket's ``(W, piece)`` rows,
  divided by the world size, the way the reductions of :mod:`.grad_reducer` send it;
- :func:`plan_buckets`: the buckets one backward launches for gradients arriving with given pieces;
- :func:`pool_buffer_numel`: the size of the reusable bucket buffers.

The last two allocate nothing, so they answer for a model on the ``meta`` device; the reducer uses the same rules.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["plan_buckets", "pool_buffer_numel", "write_rank_major", "write_own_row_last"]


def plan_buckets(pieces: Iterable[int], bucket_size: int, world_size: int) -> list[int]:
    """The padded element counts of the buckets one backward launches when gradients of one dtype arrive with
    these per-rank ``pieces``, in this order: each adds ``piece * world_size`` to the open bucket, which launches
    once it holds ``bucket_size``; the last, partial one launches at the end of backward. No tensor is made, so
    it answers for a model on the ``meta`` device (the reducer launches exactly these)."""
    buckets: list[int] = []
    elements = 0
    for piece in pieces:
        elements += piece * world_size
        if elements >= bucket_size:
            buckets.append(elements)
            elements = 0
    if elements:
        buckets.append(elements)
    return buckets


def pool_buffer_numel(bucket_size: int, pieces: Iterable[int], world_size: int) -> int:
    """The smallest buffer the reducer's pool allocates: a bucket, so buckets of different sizes share buffers,
    but never more than every piece padded (``sum(pieces) * world_size``). Pure, as :func:`plan_buckets`."""
    return min(bucket_size, sum(pieces) * world_size)


def write_rank_major(dst: torch.Tensor, grad: torch.Tensor, divisor: int) -> None:
    """``dst`` (``(W, piece)``, rows may be strided) = ``grad`` flattened, zero-padded to ``W * piece`` and divided
    by ``divisor`` (1: copied), in one pass over ``grad``."""
    world, piece = dst.shape
    flat = grad.reshape(-1)
    full, rest = divmod(flat.numel(), piece)
    rows = [(dst[:full], flat[: full * piece].view(full, piece))] if full else []
    if rest:
        rows.append((dst[full, :rest], flat[full * piece :]))
        dst[full, rest:].zero_()
    for target, source in rows:
        if divisor == 1:
            target.copy_(source)
        else:
            torch.div(source, divisor, out=target)
    if full + (1 if rest else 0) < world:
        dst[full + (1 if rest else 0) :].zero_()


def write_own_row_last(dst: torch.Tensor, grad: torch.Tensor, divisor: int, rank: int) -> None:
    """:func:`write_rank_major` with rank ``rank``'s row moved to the end: ``dst`` rows ``0 .. W-2`` hold the other
    ranks' pieces in rank order (the input of an exchange that skips this rank) and row ``W-1`` this rank's."""
    world, piece = dst.shape
    flat = grad.reshape(-1)
    # (first logical row, end logical row, first physical row)
    for first, end, at in ((0, rank, 0), (rank, rank + 1, world - 1), (rank + 1, world, rank)):
        if end > first:
            write_rank_major(dst[at : at + end - first], flat[first * piece : end * piece], divisor)
