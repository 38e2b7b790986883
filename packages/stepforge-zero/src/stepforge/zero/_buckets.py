# SPDX-License-Identifier: Apache-2.0
"""Gradient reduction in buckets, driven by post-accumulate-grad hooks during backward.

A hook on every working parameter hands its freshly accumulated ``.grad`` to :class:`GradReducer` and frees it.
Gradients wait in a bucket per gradient dtype until ``reduce_bucket_size`` elements (counted padded) are
there; the bucket is then laid out rank-major (rank ``r``'s pieces of every parameter in the bucket side by
side; the division by the world size is done by the same copy) and reduced by the algorithm of
:mod:`._algorithm`:

- ``"reduce_scatter"``: ``reduce_scatter_tensor`` -- each rank receives only its row;
- ``"all_reduce"``: ``all_reduce`` -- each rank copies its row out of the result and frees the bucket.

With ``overlap_communication`` the collective is launched asynchronously and backward goes on; the results
are added into the slots' fp32 (master-dtype) gradient pieces when :meth:`GradReducer.wait` runs (before
clipping or stepping), or as soon as more than ``MAX_IN_FLIGHT`` buckets are in flight. A callback queued on the
autograd engine launches the last partial bucket at the end of every backward, so at most the buckets in flight
exist beside the shards. The first reduction of a step hands each slot a view into the bucket's received row
(no copy: the row is 1/N of the bucket and holds only this rank's pieces), later ones add into it.

While :attr:`GradReducer.enabled` is ``False`` (``no_sync``), hooks leave ``.grad`` alone: full local
gradients accumulate as usual and are reduced once, by the first synchronised backward or by :meth:`flush_local`.

:meth:`GradReducer.sync` is the one point where a step's gradients become final: it flushes what ``no_sync``
left in ``param.grad``, waits for the buckets in flight and marks the reduction done until the next backward
reaches a managed parameter (or :meth:`GradReducer.discard`), so calling it again before then does nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from stepforge.core import queue_backward_callback

from ._partition import Slot
from ._wire import WireFormat

__all__ = ["GradReducer", "CollectiveCounter", "MAX_IN_FLIGHT", "write_rank_major"]

#: asynchronous bucket reductions allowed in flight; launching one more first finishes the oldest, so a rank
#: holds at most its pieces plus this many buckets (and the one being filled) during backward
MAX_IN_FLIGHT = 2


class CollectiveCounter:
    """How many reduce collectives were launched, and how many times a step's reduction was completed by
    :meth:`GradReducer.sync` (for tests and the benchmark)."""

    def __init__(self) -> None:
        self.reduce_scatter = 0
        self.all_reduce = 0
        self.syncs = 0


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


class _Bucket:
    def __init__(self) -> None:
        self.items: list[tuple[Slot, torch.Tensor]] = []
        self.elements = 0  # padded elements (piece * world size per item)


#: a launched reduction: (work, this rank's row, (slot, offset) per item, bucket elements, the all-reduced
#: bucket or None)
_Flight = tuple[Any, torch.Tensor, list[tuple[Slot, int]], int, torch.Tensor | None]


class GradReducer:
    """Buckets, hooks and in-flight reductions of one :class:`LowLevelZeroOptimizer`.

    Args:
        slots: every managed parameter's slot.
        stage: 1 or 2 (picks the algorithm when ``algorithm`` is ``None``: stage 1 all-reduce, stage 2
            reduce-scatter).
        bucket_size: elements per bucket (padded count).
        overlap: launch collectives asynchronously.
        group: the process group (``None``: the default group), world_size and rank in it.
        wire: how buckets travel (``communication_dtype`` / fp8, see :mod:`._wire`); ``None``: as they are.
        algorithm: ``"all_reduce"`` or ``"reduce_scatter"`` (see :mod:`._algorithm`).
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
        self._buckets: dict[torch.dtype, _Bucket] = {}
        self._in_flight: list[_Flight] = []
        self.peak_in_flight = 0  # most bucket elements launched and not yet added into the pieces
        self._callback_queued = False
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
        world = self.world_size
        per_rank = sum(slot.piece for slot, _ in bucket.items)
        device = bucket.items[0][1].device
        flat = torch.empty((world, per_rank), dtype=dtype, device=device)
        layout: list[tuple[Slot, int]] = []
        offset = 0
        for slot, grad in bucket.items:
            write_rank_major(flat[:, offset : offset + slot.piece], grad, world)
            layout.append((slot, offset))
            offset += slot.piece
        bucket.items.clear()
        if world == 1:
            self._accumulate(flat.view(-1), layout)
            return
        whole: torch.Tensor | None = flat  # an all-reduced bucket lives until its row is copied out
        if self.algorithm == "reduce_scatter":
            out = torch.empty(per_rank, dtype=dtype, device=device)
            work = self.wire.reduce_scatter(
                out, flat.view(-1), group=self.group, world_size=world, async_op=self.overlap
            )
            self.counter.reduce_scatter += 1
            whole = None
        else:
            work = self.wire.all_reduce(flat, group=self.group, world_size=world, async_op=self.overlap)
            out = flat[self.rank]
            self.counter.all_reduce += 1
        del flat
        if self.overlap:
            self._in_flight.append((work, out, layout, world * per_rank, whole))
            self.peak_in_flight = max(self.peak_in_flight, sum(f[3] for f in self._in_flight))
            while len(self._in_flight) > MAX_IN_FLIGHT:  # bound the memory: finish the oldest
                self._finish(self._in_flight.pop(0))
        else:
            self.peak_in_flight = max(self.peak_in_flight, world * per_rank)
            self._finish((work, out, layout, world * per_rank, whole))

    def _finish(self, flight: _Flight) -> None:
        work, out, layout, _, whole = flight
        if work is not None:  # None: a synchronous collective, already done
            work.wait()
        if whole is not None:
            out = out.clone()  # keep this rank's row only; the all-reduced bucket is freed with ``whole``
        self._accumulate(out, layout)

    def _accumulate(self, out: torch.Tensor, layout: list[tuple[Slot, int]]) -> None:
        for slot, offset in layout:
            piece = out[offset : offset + slot.valid]
            if slot.grad is None:
                same = piece.dtype == slot.master.dtype and piece.device == slot.master.device
                # a view into the received row (which holds only this rank's pieces): no copy
                slot.grad = piece if same else piece.to(device=slot.master.device, dtype=slot.master.dtype)
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
            if flight[0] is not None:
                flight[0].wait()
        self._buckets.clear()
        self.synced = False

    @property
    def pending(self) -> bool:
        """Whether reductions are in flight or buckets hold gradients."""
        return bool(self._in_flight) or any(b.items for b in self._buckets.values())
