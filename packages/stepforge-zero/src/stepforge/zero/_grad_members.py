# SPDX-License-Identifier: Apache-2.0
"""The gradient members of ``LowLevelZeroOptimizer`` (synchronise once, zero, scale, unscale, clip): a mixin over
the :class:`~._grad_pieces.GradPieces` and the loss scaler the optimizer builds; the tensor work is in
:mod:`._grad_pieces`."""

from __future__ import annotations

import torch

from stepforge.core.precision import DynamicLossScaler

from ._grad_norm import check_clip_args
from ._grad_pieces import GradPieces
from ._param_gather import StagingBuffers

__all__ = ["GradientMembers"]


class GradientMembers:
    """``sync_grads``, ``zero_grad``, ``scale_grads_``, ``unscale_``, ``clip_grad_norm_`` and the size of the
    reusable communication buffers of a ZeRO optimizer (see the module docstring)."""

    _pieces: GradPieces
    _staging: StagingBuffers
    _scaling: bool
    _last_grad_norm: float | None
    scaler: DynamicLossScaler

    @property
    def require_grad_sync(self) -> bool:
        """Whether backward reduces gradients (``False`` inside ``no_sync``; a plugin may set it)."""
        return self._pieces.reducer.enabled

    @require_grad_sync.setter
    def require_grad_sync(self, value: bool) -> None:
        self._pieces.reducer.enabled = bool(value)

    @property
    def communication_buffer_bytes(self) -> int:
        """Bytes of communication buffers kept between steps for reuse, beside the gradient pieces (1/N of the
        gradients): the bucket buffers (at most the buckets in flight plus one) and the parameter gather's
        staging tables (the parameters below ``DIRECT_MIN`` elements, gathered through one table per chunk)."""
        return self._pieces.reducer.pool.held_bytes + self._staging.held_bytes

    def sync_grads(self) -> bool:
        """Make this step's gradients final: reduce what :meth:`no_sync` left in ``param.grad``, wait for the
        buckets in flight and add them into this rank's pieces. The one synchronisation point of a step.

        :meth:`scale_grads_`, :meth:`unscale_`, :meth:`clip_grad_norm_` and :meth:`step` call it first; it
        works once and then does nothing until the next backward reaches a managed parameter or
        :meth:`zero_grad` runs. Inside :meth:`no_sync` it only waits for reductions in flight (the window's
        local gradients stay local). Returns whether it synchronised.
        """
        return self._pieces.sync(self.require_grad_sync)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the reduced gradient pieces and any local ``param.grad`` (waits for reductions in flight)."""
        self._pieces.zero_(set_to_none)

    def scale_grads_(self, factor: float) -> None:
        """Multiply every gradient the next step will use by ``factor`` (stepforge-accum's window weight)."""
        self.sync_grads()
        self._pieces.scale_(factor)

    def unscale_(self) -> None:
        """Divide the step's gradient pieces by the loss scale, once per step (no-op without fp16 scaling);
        ``scaler.found_inf`` then says whether any rank overflowed (the step will be skipped)."""
        self.sync_grads()
        self._pieces.unscale_(self.scaler if self._scaling else None)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every rank's gradient pieces (one small all-reduce); returns that norm.

        Same rule as ``torch.nn.utils.clip_grad_norm_``: gradients are multiplied by
        ``min(1, max_norm / (norm + 1e-6))``. With fp16 loss scaling the gradients are unscaled first.
        """
        check_clip_args(max_norm, norm_type)
        self.unscale_()
        self._last_grad_norm = float(norm := self._pieces.clip_(max_norm, norm_type))
        return norm
