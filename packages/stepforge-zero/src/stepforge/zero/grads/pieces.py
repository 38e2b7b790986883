# SPDX-License-Identifier: Apache-2.0
"""This rank's reduced gradient pieces and what a step does to them: synchronise once, scale, unscale once
(overflow agreed on every rank by the loss scaler), clip by the global norm, drop.

:class:`GradPieces` owns the :class:`~stepforge.zero.comm.grad_reducer.GradReducer` (which fills ``slot.grad``
from backward hooks) and is owned by ``LowLevelZeroOptimizer``; the optimizer decides *when* (loss scaling,
``max_norm``, skipping), this object does the tensor work and the small collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stepforge.core.precision import DynamicLossScaler

from ..comm.collectives import all_gather, all_reduce_small
from ..comm.grad_reducer import GradReducer
from ..state.partition import ShardLayout, Slot
from .norm import check_clip_args, clip_, global_norm

__all__ = ["GradPieces"]


class GradPieces:
    """The gradient side of one ``LowLevelZeroOptimizer``.

    Args:
        layout: the sharding (``slot.grad`` holds the reduced piece, ``valid`` elements, master dtype).
        reducer: the bucketed reduction that fills the pieces.
    """

    def __init__(self, layout: ShardLayout, reducer: GradReducer) -> None:
        self.layout = layout
        self.reducer = reducer
        self.unscaled = False  # the pieces were divided by the loss scale in this step (fp16 scaling only)
        # where the small reductions (norm, overflow flag) run: the backend's device
        self.comm_device = layout.slots[0].param.device if layout.slots else torch.device("cpu")

    def tensors(self) -> list[torch.Tensor]:
        """The non-empty reduced pieces."""
        return [s.grad for s in self.layout.slots if s.grad is not None and s.grad.numel() > 0]

    def all_reduce(self, value: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> torch.Tensor:
        """A few elements reduced over the group (result on the CPU)."""
        return all_reduce_small(value, op, self.layout, self.comm_device)

    def sync(self, require_grad_sync: bool) -> bool:
        """See ``LowLevelZeroOptimizer.sync_grads``.

        Raises:
            RuntimeError: a backward ran after the pieces were unscaled in this step (scaled and unscaled
                gradients would be summed).
        """
        if self.unscaled and not self.reducer.synced:
            raise RuntimeError(
                "LowLevelZeroOptimizer: a backward ran after unscale_() / clip_grad_norm_() in this step, so "
                "loss-scaled gradients would be added to unscaled ones; run every backward of the step first, "
                "then clip and step (or call zero_grad() to start the step again)."
            )
        if not require_grad_sync:
            self.reducer.wait()
            return False
        return self.reducer.sync()

    @property
    def held(self) -> bool:
        """Whether reduced pieces exist or reductions are pending."""
        return self.reducer.pending or any(s.grad is not None for s in self.layout.slots)

    def scale_(self, factor: float) -> None:
        """Multiply the pieces and any local ``param.grad`` (a ``no_sync`` window) by ``factor``."""
        for grad in self.tensors():
            grad.mul_(factor)
        for slot in self.layout.slots:
            if slot.param.grad is not None:
                slot.param.grad.mul_(factor)

    def unscale_(self, scaler: DynamicLossScaler | None) -> None:
        """Divide the pieces by ``scaler``'s scale once per step; the scaler records in ``found_inf`` whether
        any rank's pieces hold an inf or NaN (one one-element all-reduce over its group). ``None``: no loss
        scaling, nothing to do."""
        if scaler is not None and not self.unscaled:
            scaler.unscale_grads_(self.tensors())
            self.unscaled = True

    def clip_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip by the norm over every rank's pieces (``torch.nn.utils.clip_grad_norm_``'s rule); returns it."""
        norm_type = check_clip_args(max_norm, norm_type)
        grads = self.tensors()
        norm = global_norm(grads, norm_type, self.all_reduce)
        clip_(grads, norm, max_norm)
        return norm

    @torch.no_grad()
    def full_grad(self, slot: Slot, require_grad_sync: bool) -> torch.Tensor | None:
        """The full reduced gradient of ``slot``'s parameter, shaped and typed like it (collective: every rank
        asks for the same slot): synchronised first, then the pieces all-gathered. ``None`` when some rank
        holds no gradient for it."""
        self.sync(require_grad_sync)
        layout = self.layout
        held = torch.tensor([float(slot.grad is not None)])
        if layout.world_size > 1 and self.all_reduce(held, dist.ReduceOp.MIN)[0] == 0:
            return None
        if slot.grad is None:
            return None
        local = torch.zeros(slot.piece, dtype=slot.grad.dtype, device=self.comm_device)
        local[: slot.valid].copy_(slot.grad)
        table = local
        if layout.world_size > 1:
            table = local.new_empty(layout.world_size * slot.piece)
            all_gather(table, local, group=layout.group)
        full = table[: slot.numel].view_as(slot.param)
        return full.to(device=slot.param.device, dtype=slot.param.dtype)

    def close(self) -> None:
        """Stop taking gradients: remove the hooks, finish the reductions in flight, drop the pieces and the
        reusable storage."""
        self.reducer.remove_hooks()
        self.reducer.discard()
        self.reducer.release()
        for slot in self.layout.slots:
            slot.grad = None

    def zero_(self, set_to_none: bool) -> None:
        """Drop reductions in flight, the pieces (or zero them) and any local ``param.grad``."""
        self.reducer.discard()
        for slot in self.layout.slots:
            if set_to_none or slot.grad is None:
                slot.grad = None
            else:
                slot.grad.zero_()
            slot.param.grad = None
        self.unscaled = False
