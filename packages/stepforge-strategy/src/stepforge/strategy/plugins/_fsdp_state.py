# SPDX-License-Identifier: Apache-2.0
"""Full (gathered) model and optimizer state of an FSDP2 model, as ColossalAI's FSDP1 and Gemini users expect
it, through torch's ``torch.distributed.checkpoint.state_dict``; the sharded form (what DCP saves) stays
``get_model_state_dict(model)``."""

from __future__ import annotations

import os
import weakref
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import unwrap_optimizer
from stepforge.core.torch_compat import dtensor_local, set_instance_state_dict

from ..boosted_model import plugin_module
from ..boosted_optimizer import OptimizerWrapper
from ..checkpoint import commit_file, read_torch_file

__all__ = [
    "full_optim_state_dict",
    "FSDPOptimizerWrapper",
    "attach_full_state_dict",
    "save_full_optimizer",
    "load_full_optimizer",
]


def _options(only_rank_0: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # cpu_offload=True with full_state_dict=True is torch's "rank 0 only": other ranks get an empty dict
    return StateDictOptions(full_state_dict=True, cpu_offload=only_rank_0)


def full_optim_state_dict(model: nn.Module, optimizer: Any, rank0_only: bool = True) -> dict[str, Any]:
    """FSDP1's ``FullyShardedDataParallel.full_optim_state_dict`` on FSDP2: the unsharded optimizer state
    keyed by parameter FQN, on rank 0 (``{}`` elsewhere) with ``rank0_only``, else on every rank.
    Collective."""
    model = plugin_module(model)  # the boosted ModelWrapper's .module: the FSDP2 model itself
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, unwrap_optimizer(optimizer), options=_options(rank0_only))
    if rank0_only and dist.get_rank() != 0:
        return {}
    return dict(state)


class FSDPOptimizerWrapper(OptimizerWrapper):
    """The boosted optimizer of ``torch_fsdp``/``gemini``: :class:`OptimizerWrapper` plus the full optimizer
    state (``state_dict(only_rank_0=...)`` as ColossalAI's ``GeminiOptimizer``, :meth:`full_optim_state_dict`
    as FSDP1)."""

    def __init__(self, optimizer: Any, *, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self._fsdp_model = model  # not OptimizerWrapper's optional bound model: always the sharded one

    def state_dict(self, only_rank_0: bool | None = None) -> dict[str, Any]:
        """``only_rank_0=None``: this rank's state of its shards (torch's); ``True``/``False``: the full state
        on rank 0 only or on every rank (collective). ``grad_scaler`` is added with fp16."""
        if only_rank_0 is None:
            return super().state_dict()
        state = self.full_optim_state_dict(rank0_only=only_rank_0)
        if state and self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def full_optim_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """See :func:`full_optim_state_dict`."""
        return full_optim_state_dict(self._fsdp_model, self.optim, rank0_only=rank0_only)


def attach_full_state_dict(model: nn.Module, *, only_rank_0: bool) -> None:
    """Make the sharded ``model``'s ``state_dict()`` the full state, a snapshot (collective), on rank 0 only
    (``GeminiDDP``) or on every rank (FSDP1's ``FULL_STATE_DICT``) as ``only_rank_0`` says. Called with
    ``nn.Module.state_dict``'s own arguments (a parent, torch's DCP helpers) it is the class's: this rank's
    shards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model_ref = weakref.ref(model)  # DCP's registry of such methods must not keep the model alive
    default = only_rank_0

    def state_dict(*args: Any, only_rank_0: bool | None = None, **kwargs: Any) -> Any:
        module = model_ref()
        if module is None:  # pragma: no cover - the method lives in the module's own __dict__
            raise RuntimeError("state_dict: the model it belongs to no longer exists.")
        if args or kwargs:
            if only_rank_0 is not None:
                raise TypeError("state_dict(only_rank_0=...) takes no other argument.")
            return type(module).state_dict(module, *args, **kwargs)
        rank_0 = default if only_rank_0 is None else only_rank_0
        state = get_model_state_dict(module, options=_options(rank_0))
        if rank_0 and dist.get_rank() != 0:
            return {}
        # a gathered shard is a new tensor, but a replicated unit's parameter or a buffer is the live one
        live = {
            dtensor_local(t).untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
        }
        return {
            key: value.detach().clone() if value.untyped_storage().data_ptr() in live else value.detach()
            for key, value in cast(dict[str, torch.Tensor], state).items()  # full_state_dict: plain tensors
        }

    set_instance_state_dict(model, state_dict)


def save_full_optimizer(model: nn.Module, optimizer: Any, checkpoint: str | os.PathLike[str]) -> None:
    """Write :func:`full_optim_state_dict` (plus ``grad_scaler``) to the one file ``checkpoint`` on rank 0, as
    ColossalAI's FSDP checkpoint IO does, through the one checkpoint writer (atomic, with its manifest).
    Collective."""
    model = plugin_module(model)  # the boosted ModelWrapper's .module: the FSDP2 model itself
    state = full_optim_state_dict(model, optimizer, rank0_only=True)
    if isinstance(optimizer, OptimizerWrapper) and state:
        scaler = optimizer.scaler_state_dict()
        if scaler is not None:
            state["grad_scaler"] = scaler
    commit_file(
        checkpoint, lambda tmp: torch.save(state, tmp), arg="checkpoint", where="save_optimizer",
        meta={"kind": "optimizer", "format": "torch", "layout": "full"},
    )  # fmt: skip


def load_full_optimizer(model: nn.Module, optimizer: Any, checkpoint: str | os.PathLike[str]) -> None:
    """Load a :func:`save_full_optimizer` file (or FSDP1's full state keyed by FQN) at this world size: every
    rank reads it (``weights_only``) and keeps its shard. Collective."""
    model = plugin_module(model)  # the boosted ModelWrapper's .module: the FSDP2 model itself
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = read_torch_file(checkpoint, where="load_optimizer")  # checked, weights_only
    scaler = state.pop("grad_scaler", None)
    set_optimizer_state_dict(
        model, unwrap_optimizer(optimizer), state, options=StateDictOptions(full_state_dict=True)
    )
    if isinstance(optimizer, OptimizerWrapper):
        optimizer.load_scaler_state_dict(scaler)
