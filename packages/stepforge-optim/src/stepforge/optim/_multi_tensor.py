# SPDX-License-Identifier: Apache-2.0
"""Multi-tensor plumbing shared by :class:`Lamb` and :class:`Lars`: segments, cache-sized waves, norms.

An update runs as *waves*: lists of *pieces* (1-D views ``t.view(-1)[start:stop]`` of a bucket's tensors), every
element-wise step one ``torch._foreach_*`` call over a wave. Off-CPU a bucket is one wave of whole tensors: one
launch set, no host synchronisation. On CPU a bucket is cut into segments (:func:`split_segments`) and those into
waves of about ``chunk_size`` elements (small tensors share a wave, large ones are split), so that the passes of
a wave run on data in L2. CPU updates are bound by memory and element-wise compute, so this is about as fast as a
per-parameter loop or somewhat faster (1-1.7x in ``tools/bench/optim/bench_optim.py``); the multi-tensor gain
proper is on accelerators. Per-tensor norms are summed over pieces with ``index_add_`` on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from stepforge.core.torch_compat import dtensor_local as local  # the shard itself, same storage
from stepforge.core.torch_compat import is_dtensor

__all__ = [
    "TensorList",
    "plan_waves",
    "pieces_of",
    "segment_norms",
    "gather_pieces",
    "default_chunk_size",
    "split_segments",
    "contiguous_locals",
    "copy_back",
    "decayed_grads",
    "reduce_norms",
    "reduce_square_sums",
]

# 1 MiB of fp32 per array per wave: the arrays a wave touches stay in L2/L3, and each op is large enough
# that OpenMP's per-op fork/join (costly on busy machines) stays small next to the work.
_CPU_CHUNK = 1 << 18


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened tensor number ``index`` of a bucket."""

    index: int
    start: int
    stop: int


#: A ``torch._foreach_*`` tensor list (torch's stubs type the ops' results as tuples; they are lists at run time).
TensorList = list[torch.Tensor] | tuple[torch.Tensor, ...]


class Wave(NamedTuple):
    """One ``torch._foreach_*`` call's worth of pieces, and the bucket-tensor index of each piece."""

    pieces: tuple[Piece, ...]
    owners: torch.Tensor | None  # int64 (len(pieces),) on the bucket's device; None: whole tensors 0..n-1


def default_chunk_size(device: torch.device) -> int | None:
    """Elements per wave: ``None`` (whole bucket, one launch set) off-CPU, 262144 on CPU."""
    return _CPU_CHUNK if device.type == "cpu" else None


def split_segments(tensors: Sequence[torch.Tensor], chunk_size: int | None) -> list[list[torch.Tensor]]:
    """On CPU, consecutive runs of whole ``tensors`` of at most four waves (a larger tensor runs alone), each
    updated start to finish before the next, so that what a two-phase update keeps between its phases (LAMB's
    ``u``) stays in the last-level cache. Off-CPU the bucket is one segment (one launch set)."""
    if not tensors or tensors[0].device.type != "cpu":
        return [list(tensors)]
    limit = 4 * (chunk_size or _CPU_CHUNK)
    out: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        n = t.numel()
        if current and size + n > limit:
            out.append(current)
            current, size = [], 0
        current.append(t)
        size += n
    if current:
        out.append(current)
    return out


def plan_waves(numels: Sequence[int], chunk_size: int | None, device: torch.device) -> list[Wave]:
    """Cut tensors of ``numels`` elements into waves of at most ``chunk_size`` elements (``None``: one wave),
    never reordering them: results depend on the plan only through reduction order."""

    def finish(pieces: list[Piece]) -> Wave:
        owners = torch.tensor([p.index for p in pieces], dtype=torch.int64, device=device)
        return Wave(tuple(pieces), owners)

    if chunk_size is None:
        # Whole tensors in order: per-tensor results are the per-piece results, no index on the device needed.
        return [Wave(tuple(Piece(i, 0, n) for i, n in enumerate(numels)), None)] if numels else []
    waves: list[Wave] = []
    current: list[Piece] = []
    room = chunk_size
    for index, numel in enumerate(numels):
        start = 0
        while start < numel:
            take = min(room, numel - start)
            current.append(Piece(index, start, start + take))
            start += take
            room -= take
            if room == 0:
                waves.append(finish(current))
                current, room = [], chunk_size
    if current:
        waves.append(finish(current))
    return waves


def pieces_of(tensors: Sequence[torch.Tensor], wave: Wave) -> list[torch.Tensor]:
    """The views of ``tensors`` that ``wave`` names; a whole tensor is itself (``_foreach`` ops only need
    corresponding pieces to have one shape, and most tensors of a model are small and never split)."""
    out = []
    for p in wave.pieces:
        t = tensors[p.index]
        whole = wave.owners is None or (p.start == 0 and p.stop == t.numel())
        out.append(t if whole else t.view(-1)[p.start : p.stop])
    return out


def segment_norms(
    piece_norms: Iterable[tuple[Wave, Sequence[torch.Tensor]]],
    count: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per-tensor L2 norms (shape ``(count,)``, ``dtype``) from the L2 norms of every piece of every wave."""
    items = list(piece_norms)
    if len(items) == 1 and items[0][0].owners is None:
        return torch.stack(list(items[0][1])).to(dtype)
    total = torch.zeros(count, dtype=dtype, device=device)
    for wave, norms in items:  # several waves: every one has owners
        total.index_add_(0, wave.owners, torch.stack(list(norms)).to(dtype).square())  # type: ignore[arg-type]
    return total.sqrt()


def gather_pieces(values: torch.Tensor, wave: Wave) -> list[torch.Tensor]:
    """``values[owner]`` for every piece of ``wave``, as 0-dim tensors (per-tensor factors for ``_foreach``)."""
    picked = values if wave.owners is None else values.index_select(0, wave.owners)
    return list(picked.unbind(0))


def contiguous_locals(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], *states: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], ...]:
    """The local shards ``(params, grads, targets, *states)``, ``targets`` being what is updated in place of the
    params. Pieces must be plain slices, so grads of expanded/transposed params are copied once, and a bucket with
    a strided parameter is updated through contiguous copies that :func:`copy_back` writes into the parameters."""
    params = [local(p) for p in params]
    grads = [local(g) for g in grads]
    if any(not g.is_contiguous() for g in grads):
        grads = [g.contiguous() for g in grads]
    strided = any(not p.is_contiguous() for p in params)
    targets = [p.contiguous() if strided else p for p in params]
    return params, grads, targets, *([local(t) for t in ts] for ts in states)


def copy_back(params: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
    """Write the updated contiguous copies of strided parameters back (see :func:`contiguous_locals`)."""
    for p, t in zip(params, targets, strict=True):
        if t is not p:
            p.copy_(t)


def decayed_grads(
    grads: TensorList, p32: TensorList, divisor: torch.Tensor | None, maximize: bool, weight_decay: float
) -> tuple[TensorList, bool]:
    """``±grads / divisor + weight_decay * p`` in the parameters' math dtype, and whether that is a new list.

    ``grads`` (views of ``p.grad``) are never written: ops run in place only on our own copies, and negation is
    the binary ``mul`` when out of place (out-of-place unary foreach ops on CPU views are slow, see ``_lamb``).
    """
    mdtype = p32[0].dtype
    own = grads[0].dtype != mdtype
    g = [x.to(mdtype) for x in grads] if own else grads
    if divisor is not None:
        g = torch._foreach_div(g, divisor.to(device=g[0].device, dtype=mdtype, non_blocking=True))
        own = True
    if maximize:
        if own:
            torch._foreach_neg_(g)
        else:
            g = torch._foreach_mul(g, -1.0)
        own = True
    if weight_decay != 0:
        if own:
            torch._foreach_add_(g, p32, alpha=weight_decay)
        else:
            g = torch._foreach_add(g, p32, alpha=weight_decay)
        own = True
    return g, own


# DTensor (FSDP2) parameters: the update runs on each rank's local shard, which for element-wise math is the same
# as on the whole tensor. A norm is not: the L2 norm of a sharded parameter is sqrt(sum of the local squared
# norms) over the mesh dimensions the tensor is sharded on (replicated ones already hold the same values). With
# that reduction an FSDP2 run of Lamb/Lars equals the unsharded run.
def reduce_square_sums(squares: torch.Tensor, like: Any) -> torch.Tensor:
    """All-reduce (sum) ``squares`` (local sums of squares) over the mesh dimensions ``like`` is sharded on."""
    if not is_dtensor(like) or not dist.is_initialized():
        return squares
    mesh = like.device_mesh
    for dim, placement in enumerate(like.placements):
        if placement.is_shard():
            dist.all_reduce(squares, group=mesh.get_group(dim))
    return squares


def reduce_norms(norms: torch.Tensor, like: Any) -> torch.Tensor:
    """Global L2 norms from per-shard L2 norms (one entry per tensor of a bucket of DTensors)."""
    if not is_dtensor(like) or not dist.is_initialized():
        return norms
    return reduce_square_sums(norms.square(), like).sqrt()
