# SPDX-License-Identifier: Apache-2.0
"""The members of ColossalAI's ``LowLevelZeroOptimizer`` that users' code touches beside the ``torch.optim``
interface: its lifetime (hooks removed in ``__del__``, plus an explicit :meth:`close`), the master weights
(:meth:`update_master_params` and the working/master mappings) and :meth:`get_param_grad`. A mixin of :class:`~stepforge.zero.low_level.LowLevelZeroOptimizer`, which
provides the layout, the reducer and the gradient pieces it works on."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ._buckets import GradReducer
from ._comm import all_gather
from ._grad_pieces import GradPieces
from ._param_gather import StagingBuffers
from ._partition import ShardLayout

__all__ = ["ColossalAIMembers"]


class ColossalAIMembers:
    """ColossalAI-named members over a ZeRO optimizer's :class:`ShardLayout` (see the module docstring)."""

    _layout: ShardLayout
    _reducer: GradReducer
    _pieces: GradPieces
    _staging: StagingBuffers
    _closed = False
    wait_for_param_gather: Callable[[], None]
    _last_grad_norm: float | None = None  # set by clip_grad_norm_ (and so by a step with max_norm > 0)

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
        self.wait_for_param_gather()
        self._reducer.remove_hooks()
        self._reducer.discard()
        self._reducer.release()
        self._staging.clear()
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
    @property
    def working_to_master_param(self) -> dict[int, torch.Tensor]:
        """``id(working parameter)`` -> this rank's master piece of it (1-D, ``valid`` elements, fp32 for an
        fp16/bf16 parameter with ``master_weights``; a view into the parameter when it is its own master).
        ColossalAI's mapping, keyed the same way; a new dict at every read."""
        return {id(s.param): s.master for s in self._layout.slots}

    @property
    def master_to_working_param(self) -> dict[int, torch.Tensor]:
        """``id(master piece)`` -> the working parameter it belongs to (ColossalAI's mapping)."""
        return {id(s.master): s.param for s in self._layout.slots}

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """ColossalAI's getter of :attr:`working_to_master_param`."""
        return self.working_to_master_param

    def get_master_to_working_map(self) -> dict[int, torch.Tensor]:
        """ColossalAI's getter of :attr:`master_to_working_param`."""
        return self.master_to_working_param

    def get_param_padding_size(self, param: torch.Tensor) -> int:
        """Zeros that pad ``param``'s flat ``numel`` to ``world_size`` equal pieces (ColossalAI's member:
        ``pad(param.view(-1), (0, padding)).chunk(world_size)[rank]`` is this rank's piece; stepforge's master
        piece holds only its ``valid`` elements, without the padding).

        Raises:
            KeyError: ``param`` is not managed by this optimizer.
        """
        return self.get_param_padding_map()[id(param)]

    def get_param_padding_map(self) -> dict[int, int]:
        """``id(working parameter)`` -> its padding (see :meth:`get_param_padding_size`)."""
        world = self._layout.world_size
        return {id(s.param): s.piece * world - s.numel for s in self._layout.slots}

    @torch.no_grad()
    def update_master_params(self, model: nn.Module | None = None) -> None:
        """Copy the working parameters into this rank's master pieces, e.g. after ``model.load_state_dict``:
        without it the next :meth:`step` (even at lr 0) writes the old masters back into the model.

        Args:
            model: only its parameters that this optimizer manages (ColossalAI's signature); ``None``: every
                managed parameter. No collective: each rank copies its own pieces.
        """
        self.wait_for_param_gather()  # a gather landing after this copy would overwrite the weights again
        wanted = None if model is None else {id(p) for p in model.parameters()}
        for slot in self._layout.slots:
            if slot.valid and slot.separate_master and (wanted is None or id(slot.param) in wanted):
                piece = slot.param.detach().reshape(-1)[slot.start : slot.start + slot.valid]
                slot.master.copy_(piece)

    # -- gradients -----------------------------------------------------------------------------------------
    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: object) -> float | None:
        """The global gradient norm of the last clipping (ColossalAI's member, which also returns the norm its
        last step computed; ``norm_type`` and ``kwargs`` are ignored there as here). Recorded by
        ``clip_grad_norm_``, so by every :meth:`step` with ``max_norm > 0``; ``None`` when none was computed
        yet (without clipping stepforge skips that all-reduce, where ColossalAI always makes it)."""
        return self._last_grad_norm

    @torch.no_grad()
    def get_param_grad(self, working_param: torch.Tensor) -> torch.Tensor | None:
        """The full reduced (averaged over the ranks) gradient of ``working_param``, shaped and typed like
        it, as ColossalAI's member returns it. Collective (every rank calls it for the same parameter): the
        step's gradients are synchronised first, then the pieces are all-gathered. Before ``unscale_``/the
        step they carry the fp16 loss scale. ``None`` when no gradient is held (no backward since
        ``zero_grad``).

        Raises:
            KeyError: ``working_param`` is not managed by this optimizer.
        """
        slot = next((s for s in self._layout.slots if s.param is working_param), None)
        if slot is None:
            raise KeyError(
                "get_param_grad: working_param is not one of this optimizer's parameters; pass a parameter "
                "of the model the optimizer was built over."
            )
        self._pieces.sync(self._reducer.enabled)
        held = torch.tensor([float(slot.grad is not None)])
        if self._layout.world_size > 1 and self._pieces.all_reduce(held, dist.ReduceOp.MIN)[0] == 0:
            return None
        if slot.grad is None:
            return None
        local = torch.zeros(slot.piece, dtype=slot.grad.dtype, device=self._pieces.comm_device)
        local[: slot.valid].copy_(slot.grad)
        table = local
        if self._layout.world_size > 1:
            table = local.new_empty(self._layout.world_size * slot.piece)
            all_gather(table, local, group=self._layout.group)
        full = table[: slot.numel].view_as(working_param)
        return full.to(device=working_param.device, dtype=working_param.dtype)
