# SPDX-License-Identifier: Apache-2.0
"""Gradient reduction in buckets, driven by post-accumulate-grad hooks during backward.

A hook on every working parameter hands its freshly accumulated ``.grad`` to :class:`GradReducer` and frees it.
Gradients wait in a bucket per gradient dtype until ``reduce_bucket_size`` elements (counted padded) are
there; the bucket is then reduced by the algorithm of :mod:`.algorithm`, the division by the world size done
before the sum (as DDP does):

- ``"reduce_scatter"``: the bucket is laid out rank-major (rank ``r``'s pieces of every parameter side by side,
  divided by the same copy) and ``reduce_scatter_tensor`` hands each rank only its row;
- ``"all_reduce"``: the gradients are all-reduced as they are laid out (a lone gradient in place, several
  concatenated), and each rank reads its piece of every parameter at the piece's range (``torch.chunk`` layout:
  one contiguous range per parameter);
- ``"all_to_all"``: the bucket is laid out rank-major with this rank's own row last; ``all_to_all_single`` sends
  the other ``N - 1`` rows (rank ``r`` receives every other rank's row ``r``; a rank's own row never travels,
  not even as gloo's local copy) and the ``N`` rows are summed here in rank order, straight into the pieces.

With ``overlap_communication`` the collective is launched asynchronously and backward goes on; the results
are added into the slots' fp32 (master-dtype) gradient pieces when :meth:`GradReducer.wait` runs (before
clipping or stepping), or as soon as more than ``MAX_IN_FLIGHT`` buckets are in flight. A callback queued on the
autograd engine launches the last partial bucket at the end of every backward, so at most the buckets in flight
exist beside the shards. The pieces and the bucket buffers are reused from step to step (:mod:`.buffers`):
the first reduction of a step copies into the pieces, later ones add into them. How a bucket is laid out, and
which buckets a backward launches, are pure functions of :mod:`.bucket_layout`.

While :attr:`GradReducer.enabled` is ``False`` (``no_sync``), hooks leave ``.grad`` alone: full local
gradients accumulate as usual and are reduced once, by the first synchronised backward or by :meth:`flush_local`.

:meth:`GradReducer.sync` is the one point where a step's gradients become final: it flushes what ``no_sync``
left in ``param.grad``, waits for the buckets in flight and marks the reduction done until the next backward
reaches a managed parameter (or :meth:`GradReducer.discard`), so calling it again before then does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stepforge.core.torch_compat import queue_backward_callback

from ..phases import PhaseObserver, no_phase
from ..state.partition import Slot
from .bucket_layout import pool_buffer_numel, write_own_row_last, write_rank_major
from .buffers import BufferPool, PieceStore
from .wire import WireFormat

__all__ = ["GradReducer", "CollectiveCounter", "MAX_IN_FLIGHT"]

#: asynchronous bucket reductions allowed in flight; launching one more first finishes the oldest, so a rank
#: holds at most its pieces plus this many buckets (and the one being filled) during backward
MAX_IN_FLIGHT = 2


class CollectiveCounter:
    """How many reduce collectives were launched (``all_to_all``: the exchanges of the ``"all_to_all"``
    reduce-scatter), and how many times a step's reduction was completed by :meth:`GradReducer.sync` (for tests
    and the benchmark)."""

    def __init__(self) -> None:
        self.reduce_scatter = 0
        self.all_reduce = 0
        self.all_to_all = 0
        self.syncs = 0

    @property
    def reductions(self) -> int:
        """Bucket reductions launched, whatever the algorithm."""
        return self.reduce_scatter + self.all_reduce + self.all_to_all


class _Bucket:
    def __init__(self) -> None:
        self.items: list[tuple[Slot, torch.Tensor]] = []
        self.elements = 0  # padded elements (piece * world size per item)


@dataclass(eq=False)
class _Flight:
    """A launched reduction: the collective's work, the tensor this rank's pieces are read from, where each slot's
    piece starts in it, the bucket's padded element count, and the pooled buffers to hand back when done."""

    work: Any
    received: torch.Tensor | None  # the reduced row (``None``: ``rows`` are summed here instead)
    layout: list[tuple[Slot, int]]
    elements: int
    buffers: list[torch.Tensor] = field(default_factory=list)
    # ``"all_to_all"``: every rank's row, in rank order
    rows: list[torch.Tensor] = field(default_factory=list)


class GradReducer:
    """Buckets, hooks and in-flight reductions of one ``LowLevelZeroOptimizer``.

    Args:
        slots: every managed parameter's slot.
        stage: 1 or 2 (picks the algorithm when ``algorithm`` is ``None``: stage 1 all-reduce, stage 2
            reduce-scatter).
        bucket_size: elements per bucket (padded count).
        overlap: launch collectives asynchronously.
        group: the process group (``None``: the default group), world_size and rank in it.
        wire: how buckets travel (``communication_dtype`` / fp8, see :mod:`.wire`); ``None``: as they are.
        algorithm: ``"all_reduce"`` or ``"reduce_scatter"`` (see :mod:`.algorithm`).
    """

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
        self.stage = stage
        self.algorithm = algorithm or ("reduce_scatter" if stage == 2 else "all_reduce")
        self.bucket_size = bucket_size
        self.overlap = overlap
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.enabled = True
        self.synced = False  # the reduction of the gradients so far is complete (see sync)
        self.counter = CollectiveCounter()
        self.pieces = PieceStore(slots)
        # buffers of at least a bucket, so buckets of different sizes share them, but never more than the model
        self.pool = BufferPool(
            keep=MAX_IN_FLIGHT + 1,
            min_numel=pool_buffer_numel(bucket_size, (s.piece for s in slots), world_size),
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

    def release(self) -> None:
        """Drop the reusable storage (pieces and buffers): the optimizer was closed."""
        self.pieces.release()
        self.pool.clear()

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
            wire_dtype = self.wire.exchange_dtype(dtype)
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
            if flight.received is not None:
                self._accumulate(flight.received, flight.layout)
            else:
                self._accumulate_rows(flight.rows, flight.layout)
        for buffer in flight.buffers:
            self.pool.give(buffer)

    def _accumulate(self, received: torch.Tensor, layout: list[tuple[Slot, int]]) -> None:
        """Add each slot's piece of the reduced ``received`` into its reduced gradient."""
        for slot, offset in layout:
            self._add_piece(slot, received[offset : offset + slot.valid])

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

    def flush_local(self) -> None:
        """Reduce gradients still held in ``param.grad`` (accumulated under ``no_sync``), then :meth:`wait`."""
        for slot in self.slots:
            grad = slot.param.grad
            if grad is not None:
                self._add(slot, grad)
                slot.param.grad = None
        self.wait()

    def sync(self) -> bool:
        """Complete the reduction of every gradient produced so far, once: :meth:`flush_local`, then mark it
        done until the next backward reaches a managed parameter. Returns whether it did the work (``False``:
        already synced, nothing changed since)."""
        if self.synced:
            return False
        self.flush_local()
        self.synced = True
        self.counter.syncs += 1
        return True

    def discard(self) -> None:
        """Finish the reductions in flight and drop them with the unlaunched buckets (``zero_grad``)."""
        in_flight, self._in_flight = self._in_flight, []
        for flight in in_flight:
            if flight.work is not None:
                flight.work.wait()
            for buffer in flight.buffers:
                self.pool.give(buffer)
        self._buckets.clear()
        self.synced = False

    @property
    def pending(self) -> bool:
        """Whether reductions are in flight or buckets hold gradients."""
        return bool(self._in_flight) or any(b.items for b in self._buckets.values())
