# SPDX-License-Identifier: Apache-2.0
"""The members of ColossalAI's ``LowLevelZeroOptimizer`` that users' code touches beside the ``torch.optim``
interface: its lifetime (hooks removed in ``__del__``, plus an explicit :meth:`close`) and the master weights
(:meth:`update_master_params`). A mixin of :class:`~stepforge.zero.low_level.LowLevelZeroOptimizer`, which
provides the layout, the reducer and the gradient pieces it works on."""

from __future__ import annotations

import torch

from ._buckets import GradReducer
from ._grad_pieces import GradPieces
from ._partition import ShardLayout

__all__ = ["ColossalAIMembers"]


class ColossalAIMembers:
    """ColossalAI-named members over a ZeRO optimizer's :class:`ShardLayout` (see the module docstring)."""

    _layout: ShardLayout
    _reducer: GradReducer
    _pieces: GradPieces
    _closed = False

    # -- lifetime ------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the parameters' gradients are no longer taken by this optimizer)."""
        return self._closed

    def close(self) -> None:
        """Stop managing the working parameters: remove the backward hooks (a later backward fills
        ``param.grad`` as without ZeRO), finish the reductions in flight and drop the gradient pieces, so
        nothing but this object keeps the masters. Idempotent; a :meth:`step` afterwards raises."""
        if self._closed:
            return
        self._closed = True
        self._reducer.remove_hooks()
        self._reducer.discard()
        for slot in self._layout.slots:
            slot.grad = None

    def __del__(self) -> None:
        # the hooks hold the reducer (and through it the masters) and would keep taking the gradients of a
        # dead optimizer's parameters; ColossalAI removes them here as well. No collective waits in a
        # finaliser: only the hooks go.
        reducer = self.__dict__.get("_reducer")  # absent when __init__ failed before building it
        if reducer is not None:
            reducer.remove_hooks()

    # -- master weights ------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_master_params(self) -> None:
        """Copy the working parameters into the master pieces (after loading model weights)."""
        for slot in self._layout.slots:
            if slot.valid and slot.separate_master:
                piece = slot.param.detach().reshape(-1)[slot.start : slot.start + slot.valid]
                slot.master.copy_(piece)
