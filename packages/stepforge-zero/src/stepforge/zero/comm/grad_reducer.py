# SPDX-License-Identifier: Apache-2.0
"""Gradient reduction in buckets, driven by post-accumulate-grad hooks during backward.

Why one module past 400 lines: it is the whole route of a gradient from its hook to this rank's piece (bucket,
wire format, reduction, and what a step does to the pieces: sync, scale, unscale, clip), so that a backward and
a step enter it once; its leaf helpers are in :mod:`.buffers`.

A hook on every working parameter hands its fresh ``.grad`` to :class:`GradReducer` and frees it. Gradients wait in
a bucket per dtype until ``reduce_bucket_size`` (padded) elements are there; the bucket is then divided by the world
size (as DDP does) and reduced by the algorithm of :mod:`.algorithm`: ``"reduce_scatter"`` (rank-major layout, each
rank receives its row), ``"all_reduce"`` (each rank reads its pieces at their ranges) or ``"all_to_all"`` (own row
last; the other ``N - 1`` rows are exchanged, so a rank's own row never travels, and summed here into the pieces).
With ``overlap_communication`` the collective is asynchronous and its result is added into the pieces at
:meth:`GradReducer.wait`, or once more than ``MAX_IN_FLIGHT`` buckets are in flight; a callback queued on the
autograd engine launches the last partial bucket at the end of every backward. While :attr:`GradReducer.enabled`
is ``False`` (``no_sync``) hooks leave ``.grad`` alone and the window is reduced once, at the next sync.

On the wire (:class:`WireFormat`) a bucket travels as it is, cast to ColossalAI's ``communication_dtype`` (the sum
runs in that dtype), or as fp8 (``fp8_communication``, ColossalAI's scheme): scaled by ``448 / amax``, sent as
``float8_e4m3fn`` bytes (``uint8``: gloo has no fp8) with the scale, by one ``all_to_all_single`` or ``all_gather``
so every rank sums the same parts in the same order (the replicas agree bitwise), summed in fp32. A part holding
an inf/NaN travels with a NaN scale (e4m3fn saturates inf to 448), so fp16 overflow detection still sees it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core.precision import DynamicLossScaler
from stepforge.core.torch_compat import queue_backward_callback

from ..phases import PhaseObserver, no_phase
from ..state.partition import Slot
from .buffers import BufferPool, PieceStore, write_own_row_last, write_rank_major

__all__ = [
    "GradReducer",
    "CollectiveCounter",
    "MAX_IN_FLIGHT",
    "WireFormat",
    "FP8_DTYPE",
    "encode_fp8",
    "decode_fp8",
    "all_gather",
    "reduce_scatter",
    "all_gather_name",
    "reduce_scatter_name",
]

# torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` for ``*_single`` (same signatures);
# looked up at call time so that wrapping ``torch.distributed`` (tests, the benchmark) sees every call
all_gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
reduce_scatter_name = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather(output: torch.Tensor, local: torch.Tensor, *, group: Any, async_op: bool = False) -> Any:
    """``output`` (``W * local.numel()``) = every rank's ``local``, rank-major."""
    return getattr(dist, all_gather_name)(output, local, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, flat: torch.Tensor, *, group: Any, async_op: bool = False) -> Any:
    """``output`` = this rank's chunk of the element-wise sum of every rank's ``flat``."""
    return getattr(dist, reduce_scatter_name)(output, flat, group=group, async_op=async_op)


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


@dataclass
class _Pending:
    """An asynchronous collective and what turns its wire result into the caller's tensor."""

    work: Any
    finish: Callable[[], Any]

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.finish()
        return True


@dataclass(frozen=True)
class WireFormat:
    """How gradient buckets travel: ColossalAI's ``communication_dtype`` (``dtype``; ``None``: as they are) and
    ``fp8_communication`` (``fp8``, which takes precedence)."""

    dtype: torch.dtype | None = None
    fp8: bool = False

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

    def exchange(
        self, received: torch.Tensor, rows: torch.Tensor, *, rank: int, group: Any, async_op: bool
    ) -> Any:
        """``received[i]`` = this rank's row from the ``i``-th other rank, ``rows[i]`` the row for it (both
        ``(W - 1, n)``): one ``all_to_all_single`` whose splits leave this rank out (the ``"all_to_all"``
        reduce-scatter's transport; the caller sums in the wire dtype; fp8 goes through :meth:`reduce_scatter`)."""
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


#: asynchronous bucket reductions allowed in flight; launching one more first finishes the oldest, so a rank
#: holds at most its pieces plus this many buckets (and the one being filled) during backward
MAX_IN_FLIGHT = 2


@dataclass
class CollectiveCounter:
    """Reduce collectives launched, by kind, and steps whose reduction :meth:`GradReducer.sync` completed."""

    reduce_scatter: int = 0
    all_reduce: int = 0
    all_to_all: int = 0
    syncs: int = 0

    @property
    def reductions(self) -> int:
        """Bucket reductions launched, whatever the algorithm."""
        return self.reduce_scatter + self.all_reduce + self.all_to_all


@dataclass
class _Bucket:
    items: list[tuple[Slot, torch.Tensor]] = field(default_factory=list)
    elements: int = 0  # padded elements (piece * world size per item)


@dataclass(eq=False)
class _Flight:
    """A launched reduction and the pooled buffers to hand back when it is done."""

    work: Any
    received: torch.Tensor | None  # the reduced row (``None``: ``rows`` are summed here instead)
    layout: list[tuple[Slot, int]]  # where each slot's piece starts in it
    elements: int  # the bucket's padded element count
    buffers: list[torch.Tensor] = field(default_factory=list)
    # ``"all_to_all"``: every rank's row, in rank order
    rows: list[torch.Tensor] = field(default_factory=list)


class GradReducer:
    """Buckets, hooks and in-flight reductions of one ``LowLevelZeroOptimizer`` over ``slots``: buckets of
    ``bucket_size`` padded elements, launched asynchronously with ``overlap``, reduced by ``algorithm`` (see
    :mod:`.algorithm`; ``None``: stage 1 all-reduce, stage 2 reduce-scatter) over ``group`` through ``wire``."""

    def __init__(
        self,
        slots: list[Slot],
        *,
        stage: int,
        bucket_size: int,
        overlap: bool,
        group: Any,
        world_size: int,
        rank: int,
        wire: WireFormat | None = None,
        algorithm: str | None = None,
    ) -> None:
        self.slots = slots
        self.wire = wire if wire is not None else WireFormat()
        self.algorithm = algorithm or ("reduce_scatter" if stage == 2 else "all_reduce")
        self.bucket_size = bucket_size
        self.overlap = overlap
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.enabled = True
        self.synced = False  # the reduction of the gradients so far is complete (see sync)
        self.unscaled = False  # the pieces were divided by the loss scale in this step (fp16 scaling only)
        # where the small reductions (norm, overflow flag) run: the backend's device
        self.comm_device = slots[0].param.device if slots else torch.device("cpu")
        self.counter = CollectiveCounter()
        self.pieces = PieceStore(slots)
        # buffers of at least a bucket, so buckets of different sizes share them, but never more than the model
        self.pool = BufferPool(
            keep=MAX_IN_FLIGHT + 1,
            min_numel=min(bucket_size, sum(s.piece for s in slots) * world_size),
        )
        self._buckets: dict[torch.dtype, _Bucket] = {}
        self._in_flight: list[_Flight] = []
        self.peak_in_flight = 0  # most bucket elements launched and not yet added into the pieces
        self._callback_queued = False
        #: the optimizer's phase observer (:mod:`stepforge.zero.phases`): adding a bucket into the pieces runs
        #: inside ``phase("grad_to_pieces")``
        self.phase: PhaseObserver = no_phase
        self._by_param: dict[int, Slot] = {id(s.param): s for s in slots}
        self._handles = [
            s.param.register_post_accumulate_grad_hook(self._hook) for s in slots if s.param.requires_grad
        ]

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the optimizer no longer manages these parameters)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- backward side --------------------------------------------------------------------------------
    def _hook(self, param: torch.Tensor) -> None:
        self.synced = False  # a backward reached a managed parameter: the next sync has work again
        if not self.enabled or param.grad is None:
            return
        slot = self._by_param[id(param)]
        self._add(slot, param.grad)
        param.grad = None
        if not self._callback_queued:
            self._callback_queued = True
            queue_backward_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.launch_all()

    def _add(self, slot: Slot, grad: torch.Tensor) -> None:
        """Take ``grad`` into its bucket; the reducer owns it from here on (the caller drops ``param.grad``)."""
        if grad.is_sparse:
            raise RuntimeError(
                f"LowLevelZeroOptimizer: parameter {slot.index} got a sparse gradient; ZeRO shards dense "
                "gradients only (use a dense embedding, sparse=False)."
            )
        bucket = self._buckets.setdefault(grad.dtype, _Bucket())
        bucket.items.append((slot, grad))
        bucket.elements += slot.piece * self.world_size
        if bucket.elements >= self.bucket_size:
            self._launch(grad.dtype)

    def _launch(self, dtype: torch.dtype) -> None:
        bucket = self._buckets.pop(dtype, None)
        if bucket is None or not bucket.items:
            return
        if self.algorithm in ("reduce_scatter", "all_to_all") and self.world_size > 1:
            flight = self._launch_reduce_scatter(bucket.items, dtype)
        else:
            flight = self._launch_all_reduce(bucket.items, dtype)
        flight.elements = bucket.elements
        bucket.items.clear()
        if self.overlap and flight.work is not None:
            self._in_flight.append(flight)
            self.peak_in_flight = max(self.peak_in_flight, sum(f.elements for f in self._in_flight))
            while len(self._in_flight) > MAX_IN_FLIGHT:  # bound the memory: finish the oldest
                self._finish(self._in_flight.pop(0))
        else:
            self.peak_in_flight = max(self.peak_in_flight, flight.elements)
            self._finish(flight)

    def _launch_reduce_scatter(self, items: list[tuple[Slot, torch.Tensor]], dtype: torch.dtype) -> _Flight:
        """Lay the bucket out rank-major (divided by the world size) and reduce-scatter it: this rank receives
        its row, the concatenation of its pieces (``"all_to_all"``: every other rank's row, summed with its own
        when finished)."""
        world = self.world_size
        per_rank = sum(slot.piece for slot, _ in items)
        device = items[0][1].device
        send = self.pool.take(world * per_rank, dtype, device)
        flat = send[: world * per_rank].view(world, per_rank)
        exchange = self.algorithm == "all_to_all" and not self.wire.fp8
        layout: list[tuple[Slot, int]] = []
        offset = 0
        for slot, grad in items:
            if exchange:
                write_own_row_last(flat[:, offset : offset + slot.piece], grad, world, self.rank)
            else:
                write_rank_major(flat[:, offset : offset + slot.piece], grad, world)
            layout.append((slot, offset))
            offset += slot.piece
        if exchange:
            wire_dtype = self.wire.dtype or dtype  # the rows travel and are summed in the wire dtype
            table = self.pool.take((world - 1) * per_rank, wire_dtype, device)
            others = table[: (world - 1) * per_rank].view(world - 1, per_rank)
            work = self.wire.exchange(
                others, flat[:-1], rank=self.rank, group=self.group, async_op=self.overlap
            )
            self.counter.all_to_all += 1
            own = flat[-1] if wire_dtype == dtype else flat[-1].to(wire_dtype)  # summed in the wire dtype
            rows = [*others[: self.rank], own, *others[self.rank :]]
            return _Flight(work, None, layout, 0, [send, table], rows=rows)
        received = self.pool.take(per_rank, dtype, device)
        work = self.wire.reduce_scatter(
            received[:per_rank], flat.view(-1), group=self.group, world_size=world, async_op=self.overlap
        )
        self.counter.reduce_scatter += 1
        return _Flight(work, received, layout, 0, [send, received])

    def _launch_all_reduce(self, items: list[tuple[Slot, torch.Tensor]], dtype: torch.dtype) -> _Flight:
        """All-reduce the bucket's gradients divided by the world size; each slot's piece is then read at its
        range of the result. A lone contiguous gradient is reduced in place (the reducer owns it: no copy, no
        new memory); several are concatenated into a pooled buffer."""
        world = self.world_size
        if len(items) == 1 and items[0][1].is_contiguous():
            slot, grad = items[0]
            flat = grad.view(-1)
            if world > 1:
                flat.div_(world)  # the same arithmetic as the copy below: divide, then sum
            buffers: list[torch.Tensor] = []
            layout = [(slot, slot.start)]
        else:
            total = sum(slot.numel for slot, _ in items)
            buffer = self.pool.take(total, dtype, items[0][1].device)
            flat = buffer[:total]
            layout, offset = [], 0
            for slot, grad in items:
                target = flat[offset : offset + slot.numel]
                if world > 1:
                    torch.div(grad.reshape(-1), world, out=target)
                else:
                    target.copy_(grad.reshape(-1))
                layout.append((slot, offset + slot.start))
                offset += slot.numel
            buffers = [buffer]
        work = None
        if world > 1:
            work = self.wire.all_reduce(flat, group=self.group, world_size=world, async_op=self.overlap)
            self.counter.all_reduce += 1
        return _Flight(work, flat, layout, 0, buffers)

    def _finish(self, flight: _Flight) -> None:
        if flight.work is not None:  # None: a synchronous collective, already done
            flight.work.wait()
        with self.phase("grad_to_pieces"):
            if flight.received is None:
                self._accumulate_rows(flight.rows, flight.layout)
            else:  # each slot's piece of the reduced row
                for slot, offset in flight.layout:
                    self._add_piece(slot, flight.received[offset : offset + slot.valid])
        for buffer in flight.buffers:
            self.pool.give(buffer)

    def _accumulate_rows(self, rows: list[torch.Tensor], layout: list[tuple[Slot, int]]) -> None:
        """Sum each slot's piece of every rank's row (their dtype, rank order) into its reduced gradient: the
        first reduction of a step straight into the piece's storage, later ones through a temporary."""
        for slot, offset in layout:
            parts = [row[offset : offset + slot.valid] for row in rows]
            first, master = parts[0], slot.master
            if slot.grad is None and first.dtype == master.dtype and first.device == master.device:
                total = torch.add(first, parts[1], out=self.pieces.view(slot))
                slot.grad = total
            else:
                total = parts[0] + parts[1]
            for part in parts[2:]:
                total.add_(part)
            if total is not slot.grad:
                self._add_piece(slot, total)

    def _add_piece(self, slot: Slot, piece: torch.Tensor) -> None:
        if slot.grad is None:
            slot.grad = self.pieces.view(slot)
            slot.grad.copy_(piece)  # converts to the master dtype / device where they differ
        elif piece.dtype == slot.grad.dtype and piece.device == slot.grad.device:
            slot.grad.add_(piece)
        else:
            slot.grad.add_(piece.to(device=slot.grad.device, dtype=slot.grad.dtype))

    # -- step side -------------------------------------------------------------------------------------
    def launch_all(self) -> None:
        """Launch every partially filled bucket (dtype order is fixed so all ranks agree)."""
        for dtype in sorted(self._buckets, key=str):
            self._launch(dtype)

    def wait(self) -> None:
        """Launch what is left, wait for every reduction in flight and add the results into the slots."""
        self.launch_all()
        in_flight, self._in_flight = self._in_flight, []
        for flight in in_flight:
            self._finish(flight)

    def sync(self) -> bool:
        """``LowLevelZeroOptimizer.sync_grads``: reduce what ``no_sync`` left in ``param.grad`` and :meth:`wait`,
        once until the next backward reaches a managed parameter (inside ``no_sync`` only wait); returns whether
        it did. A backward after this step's unscaling is an error (scaled and unscaled gradients would sum)."""
        if self.unscaled and not self.synced:
            raise RuntimeError(
                "LowLevelZeroOptimizer: a backward ran after unscale_() / clip_grad_norm_() in this step, so "
                "loss-scaled gradients would be added to unscaled ones; run every backward of the step first, "
                "then clip and step (or call zero_grad() to start the step again)."
            )
        if not self.enabled:
            self.wait()
            return False
        if self.synced:
            return False
        for slot in self.slots:
            if slot.param.grad is not None:
                self._add(slot, slot.param.grad)
                slot.param.grad = None
        self.wait()
        self.synced = True
        self.counter.syncs += 1
        return True

    def discard(self) -> None:
        """Finish the reductions in flight and drop them with the unlaunched buckets."""
        in_flight, self._in_flight = self._in_flight, []
        for flight in in_flight:
            if flight.work is not None:
                flight.work.wait()
            for buffer in flight.buffers:
                self.pool.give(buffer)
        self._buckets.clear()
        self.synced = False

    @property
    def held(self) -> bool:
        """Whether reduced pieces exist, reductions are in flight or buckets hold gradients."""
        return (
            bool(self._in_flight)
            or any(b.items for b in self._buckets.values())
            or any(s.grad is not None for s in self.slots)
        )

    # -- what a step does to the pieces --------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        return [s.grad for s in self.slots if s.grad is not None and s.grad.numel() > 0]

    def all_reduce(self, value: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> torch.Tensor:
        """A few elements reduced over the group on the backend's device; the result on the CPU."""
        if self.world_size > 1:
            value = value.to(self.comm_device)
            dist.all_reduce(value, op=op, group=self.group)
        return value.cpu()

    def scale_(self, factor: float) -> None:
        """Multiply the pieces and any local ``param.grad`` (a ``no_sync`` window) by ``factor``."""
        for grad in self._grads():
            grad.mul_(factor)
        for slot in self.slots:
            if slot.param.grad is not None:
                slot.param.grad.mul_(factor)

    def unscale_(self, scaler: DynamicLossScaler | None) -> None:
        """Divide the pieces by ``scaler``'s scale once per step; the scaler records in ``found_inf`` whether
        any rank's pieces hold an inf or NaN (one one-element all-reduce over its group). ``None``: no loss
        scaling, nothing to do."""
        if scaler is not None and not self.unscaled:
            scaler.unscale_grads_(self._grads())
            self.unscaled = True

    def clip_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip by the ``norm_type``-norm over every rank's pieces with ``torch.nn.utils.clip_grad_norm_``'s rule
        (multiply by ``min(1, max_norm / (norm + 1e-6))``); returns that norm (fp32). Partial sums are taken in
        float64 and combined with one one-element all-reduce (SUM, or MAX for inf)."""
        grads = self._grads()
        zero = torch.zeros((), dtype=torch.float64)
        if math.isinf(norm_type):
            local = max((g.abs().max().double().cpu() for g in grads), default=zero)
            norm = self.all_reduce(local.reshape(1), dist.ReduceOp.MAX)[0].float()
        else:
            local = sum(
                (
                    torch.linalg.vector_norm(g, norm_type, dtype=torch.float64).cpu() ** norm_type
                    for g in grads
                ),
                zero,
            )
            norm = (self.all_reduce(local.reshape(1), dist.ReduceOp.SUM)[0] ** (1.0 / norm_type)).float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.device, grad.dtype))
        return norm

    @torch.no_grad()
    def full_grad(self, slot: Slot) -> torch.Tensor | None:
        """The full reduced gradient of ``slot``'s parameter, shaped and typed like it, or ``None`` when a rank
        holds none (collective: synchronised, then the pieces all-gathered)."""
        self.sync()
        held = torch.tensor([float(slot.grad is not None)])
        if self.world_size > 1 and self.all_reduce(held, dist.ReduceOp.MIN)[0] == 0:
            return None
        if slot.grad is None:
            return None
        local = torch.zeros(slot.piece, dtype=slot.grad.dtype, device=self.comm_device)
        local[: slot.valid].copy_(slot.grad)
        table = local
        if self.world_size > 1:
            table = local.new_empty(self.world_size * slot.piece)
            all_gather(table, local, group=self.group)
        return table[: slot.numel].view_as(slot.param).to(device=slot.param.device, dtype=slot.param.dtype)

    def close(self) -> None:
        """Stop taking gradients: remove the hooks, finish the reductions in flight, drop the pieces and the
        reusable storage (pieces and buffers)."""
        self.remove_hooks()
        self.discard()
        for slot in self.slots:
            slot.grad = None
        self.pieces.release()
        self.pool.clear()

    def zero_(self, set_to_none: bool) -> None:
        """Drop reductions in flight, the pieces (or zero them) and any local ``param.grad``."""
        self.discard()
        for slot in self.slots:
            if set_to_none or slot.grad is None:
                slot.grad = None
            else:
                slot.grad.zero_()
            slot.param.grad = None
        self.unscaled = False
