# SPDX-License-Identifier: Apache-2.0
""":class:`FlatShard`: one rank's contiguous range of a flattened tensor, checkpointed in the tensor's own shape.

A ZeRO rank owns a contiguous range ``[start, start + n)`` of each flattened parameter (the ``torch.chunk``
layout). A flat range of an n-d tensor is the union of a few n-d boxes (a partial first row, a block of full
rows, a partial last row, recursively in the trailing dimensions), so the rank's piece can be written to and read
from ``torch.distributed.checkpoint`` in the parameter's shape with no communication: each box is one DCP chunk.
DCP then reads, for any other layout (FSDP2's ``Shard(0)`` DTensors, a plain replicated tensor, another world
size's ranges), the overlap of its chunks with the boxes that were saved, and the reverse.

The object is a tensor of the full shape to DCP and to code that reads ``shape``/``dtype``; it implements the
protocol DCP's planners call on ``DTensor`` (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``) and the few operations a checkpoint applies to a state dict (``torch.empty_like``,
``detach``, ``.to``/``.cpu`` copies, ``clone``, ``copy_`` between two of the same geometry). Any other operation
raises ``TypeError``: read :attr:`FlatShard.local` (the rank's flat piece) instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .torch_compat import make_wrapper_subclass

__all__ = ["FlatShard", "flat_range_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes ``(offsets, sizes)`` whose union is elements ``[start, stop)`` of a row-major tensor of
    ``shape``, in flat order (at most ``2 * dims - 1`` of them)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    rest = len(shape) - 1

    def row(r: int, a: int, b: int) -> list[Box]:
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], a, b)]

    if r0 == r1:
        return row(r0, c0, c1)
    out: list[Box] = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * rest), (r1 - r0, *shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out


class FlatShard(torch.Tensor):
    """Elements ``[start, start + local.numel())`` of a flattened tensor of ``shape``, held by this rank as the
    1-D tensor :attr:`local` (see the module docstring).

    Args:
        local: this rank's piece, 1-D (may be empty).
        start: where the piece starts in the flattened tensor.
        shape: the full tensor's shape.
    """

    local: torch.Tensor
    start: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, start: int, shape: Sequence[int]) -> FlatShard:
        if local.dim() != 1:
            raise ValueError(f"FlatShard: local must be 1-D, got shape {tuple(local.shape)}.")
        numel = math.prod(shape)
        if not 0 <= start <= numel or start + local.numel() > numel:
            raise ValueError(
                f"FlatShard: the range [{start}, {start + local.numel()}) is not inside {numel} elements."
            )
        out = make_wrapper_subclass(cls, torch.Size(shape), dtype=local.dtype, device=local.device)
        out.local, out.start = local, start
        return out  # type: ignore[no-any-return]

    def __init__(self, local: torch.Tensor, start: int, shape: Sequence[int]) -> None:
        super().__init__()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"FlatShard(shape={tuple(self.shape)}, start={self.start}, local={self.local!r})"

    def boxes(self) -> list[tuple[Box, torch.Tensor]]:
        """Each box of the piece with its view into :attr:`local`, in flat order."""
        out = []
        cursor = 0
        for offsets, sizes in flat_range_boxes(self.shape, self.start, self.start + self.local.numel()):
            n = math.prod(sizes)
            out.append(((offsets, sizes), self.local[cursor : cursor + n].view(sizes)))
            cursor += n
        return out

    def flat(self) -> FlatShard:
        """The same piece, seen as part of the flattened (1-D) tensor (no copy)."""
        return FlatShard(self.local, self.start, (self.numel(),))

    # -- the checkpoint protocol DCP's planners call (as on DTensor) -------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for i, ((offsets, sizes), _) in enumerate(self.boxes())
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for (o, s), _ in self.boxes()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for (offsets, _), view in self.boxes():
            if index.offset is not None and tuple(index.offset) == offsets:
                return view
        raise ValueError(f"FlatShard: no box at {index.offset} for {index.fqn!r}.")

    # -- the operations a checkpoint applies --------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        aten = torch.ops.aten
        first = args[0]
        if func is aten.detach.default:
            return FlatShard(first.local.detach(), first.start, first.shape)
        if func in (aten.empty_like.default, aten._to_copy.default, aten.clone.default):
            return FlatShard(func(first.local, *args[1:], **kwargs), first.start, first.shape)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, FlatShard) and isinstance(src, FlatShard):
                if (dst.start, dst.local.numel(), dst.shape) == (src.start, src.local.numel(), src.shape):
                    dst.local.copy_(src.local)
                    return dst
        raise TypeError(
            f"FlatShard supports only the operations of a checkpoint (empty_like, detach, to, clone, copy_ "
            f"between equal ranges), not {func}; read .local, this rank's flat piece."
        )
