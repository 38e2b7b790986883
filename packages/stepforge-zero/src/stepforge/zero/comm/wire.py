# SPDX-License-Identifier: Apache-2.0
"""How a gradient bucket travels: as it is, cast to ColossalAI's ``communication_dtype``, or as fp8 bytes.

``communication_dtype``: the bucket is cast to that dtype for the collective and the result cast back, so the
sum itself runs in the wire dtype (ColossalAI's meaning: e.g. bf16 gradients reduced in fp32, or fp32 ones sent
as bf16 to halve the bytes).

``fp8_communication``: each rank scales its bucket by ``448 / amax`` (the e4m3 range), casts it to
``float8_e4m3fn`` and sends the bytes with its scale; the receivers decode every rank's part to fp32 and sum in
fp32 (ColossalAI's ``reduce_scatter_fp8``/``all_reduce_fp8`` scheme: fp8 on the wire, higher precision in the
reduction). The collectives move ``uint8`` -- gloo has no fp8 dtype -- one ``all_to_all_single`` for a
reduce-scatter and one ``all_gather`` for an all-reduce (every rank then sums the same parts in the same order,
so the replicas agree bitwise). A part holding an inf/NaN travels with a NaN scale (e4m3fn has no inf and
saturates it to 448), so it decodes to NaN and fp16 overflow detection still sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import all_gather, reduce_scatter

__all__ = ["WireFormat", "FP8_DTYPE", "encode_fp8", "decode_fp8"]

FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
_SCALE_BYTES = 4  # the float32 scale travels behind each part's fp8 bytes


def encode_fp8(parts: torch.Tensor) -> torch.Tensor:
    """``(k, n)`` values -> ``(k, n + 4)`` bytes: one scale for the whole tensor (``448 / amax``; 1 for an
    all-zero tensor; NaN for one holding inf/NaN, so every decoded value is NaN), each row its fp8 bytes
    followed by that scale as float32 bytes."""
    values = parts.float()
    amax = values.abs().max() if values.numel() else torch.zeros(())
    if not bool(torch.isfinite(amax)):
        value = float("nan")  # e4m3fn saturates inf to 448: a NaN scale carries the overflow instead
    else:
        value = _FP8_MAX / float(amax) if float(amax) > 0 else 1.0
    scale = torch.tensor([value], dtype=torch.float32)
    coded = (values * scale.to(values.device)).to(FP8_DTYPE).view(torch.uint8)
    scale_bytes = scale.view(torch.uint8).to(values.device).expand(parts.shape[0], _SCALE_BYTES)
    return torch.cat([coded, scale_bytes], dim=1)


def decode_fp8(rows: torch.Tensor) -> torch.Tensor:
    """``(k, n + 4)`` bytes of :func:`encode_fp8` (one row per sender) -> ``(k, n)`` fp32 values."""
    n = rows.shape[1] - _SCALE_BYTES
    values = rows[:, :n].contiguous().view(FP8_DTYPE).float()
    scales = rows[:, n:].contiguous().view(torch.float32)  # (k, 1)
    return values / scales


class _Pending:
    """An asynchronous collective and what turns its wire result into the caller's tensor."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self.work = work
        self.finish = finish

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.finish()
        return True


@dataclass(frozen=True)
class WireFormat:
    """The dtype on the wire for gradient reductions (``None`` and ``fp8=False``: as the gradients are).

    Attributes:
        dtype: ColossalAI's ``communication_dtype`` (a floating dtype) or ``None``.
        fp8: ColossalAI's ``fp8_communication`` (takes precedence over ``dtype``).
    """

    dtype: torch.dtype | None = None
    fp8: bool = False

    def __repr__(self) -> str:
        return f"WireFormat(dtype={self.dtype}, fp8={self.fp8})"

    def _cast(self, flat: torch.Tensor) -> bool:
        return self.dtype is not None and self.dtype != flat.dtype

    def reduce_scatter(
        self, out: torch.Tensor, flat: torch.Tensor, *, group: Any, world_size: int, async_op: bool
    ) -> Any:
        """``out`` = this rank's chunk of the sum over the ranks of ``flat`` (``world_size`` chunks)."""
        if self.fp8:
            send = encode_fp8(flat.view(world_size, -1))
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)

            def finish() -> None:
                out.copy_(decode_fp8(recv).sum(dim=0))

            return self._done(work, finish, async_op)
        if self._cast(flat):
            assert self.dtype is not None
            wire_out = torch.empty(out.shape, dtype=self.dtype, device=out.device)
            work = reduce_scatter(wire_out, flat.to(self.dtype), group=group, async_op=async_op)
            return self._done(work, lambda: out.copy_(wire_out), async_op)
        return reduce_scatter(out, flat, group=group, async_op=async_op)

    def exchange_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype rows travel in by :meth:`exchange` (``communication_dtype`` when it casts, else ``dtype``)."""
        return self.dtype if self.dtype is not None and self.dtype != dtype else dtype

    def exchange(
        self, received: torch.Tensor, rows: torch.Tensor, *, rank: int, group: Any, async_op: bool
    ) -> Any:
        """``received[i]`` = the row for rank ``rank`` from the ``i``-th other rank (rank order), where ``rows[i]``
        is the row for the ``i``-th other rank: both ``(W - 1, n)``, ``received`` in :meth:`exchange_dtype`. One
        ``all_to_all_single`` whose splits leave this rank out, so its own row is neither sent nor copied; the
        transport of the ``"all_to_all"`` reduce-scatter, summed by the caller in the wire dtype (fp8 goes
        through :meth:`reduce_scatter`, which decodes and sums itself)."""
        n = rows.shape[1]
        splits = [n] * (rows.shape[0] + 1)
        splits[rank] = 0
        send = rows if rows.dtype == received.dtype else rows.to(received.dtype)
        return dist.all_to_all_single(
            received.view(-1),
            send.reshape(-1),
            output_split_sizes=splits,
            input_split_sizes=splits,
            group=group,
            async_op=async_op,
        )

    def all_reduce(self, flat: torch.Tensor, *, group: Any, world_size: int, async_op: bool) -> Any:
        """``flat`` = the sum over the ranks of ``flat``, on every rank."""
        if self.fp8:
            send = encode_fp8(flat.reshape(1, -1))
            table = send.new_empty((world_size, send.shape[1]))
            work = all_gather(table.view(-1), send.view(-1), group=group, async_op=async_op)

            def finish() -> None:
                flat.copy_(decode_fp8(table).sum(dim=0).view_as(flat))

            return self._done(work, finish, async_op)
        if self._cast(flat):
            assert self.dtype is not None
            wire = flat.to(self.dtype)
            work = dist.all_reduce(wire, group=group, async_op=async_op)
            return self._done(work, lambda: flat.copy_(wire), async_op)
        return dist.all_reduce(flat, group=group, async_op=async_op)

    @staticmethod
    def _done(work: Any, finish: Callable[[], Any], async_op: bool) -> Any:
        pending = _Pending(work, finish)
        if async_op:
            return pending
        pending.wait()
        return None
