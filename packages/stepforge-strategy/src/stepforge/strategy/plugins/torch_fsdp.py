# SPDX-License-Identifier: Apache-2.0
"""``torch_fsdp`` (aliases ``fsdp``, ``TorchFSDPPlugin``): FSDP2 ``fully_shard`` per block, then the root.

The boosted model is the user's model after FSDP2's ``fully_shard``: an ``FSDPModule`` (its parameters are
DTensor shards), not FSDP1's ``FullyShardedDataParallel`` class. As FSDP1's, its ``state_dict()`` (and the
boosted ``ModelWrapper``'s) is the full, unsharded state on every rank, a fresh snapshot on every call
(collective); this rank's DTensor shards are
``torch.distributed.checkpoint.state_dict.get_model_state_dict(model.unwrap())``. FSDP1's full optimizer state
(``FSDP.full_optim_state_dict``) is :meth:`TorchFSDPPlugin.full_optim_state_dict` or the boosted optimizer's
``full_optim_state_dict()``/``state_dict(only_rank_0=...)``, through torch's ``get_optimizer_state_dict``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp import MixedPrecision as FSDP1Precision

from stepforge.core import MemoryPlan, Plugin, build_optimizer, unwrap_optimizer
from stepforge.core.precision import PLUGIN_PRECISIONS, DynamicLossScaler
from stepforge.core.torch_compat import fsdp2_no_sync

from ..data import StatefulDataLoader
from ..lazy import has_meta_tensors, lazy_state_names, materialize_model
from ._fsdp_common import (
    clip_grad_norm_by_mesh,
    param_names,
    precision_policy,
    repoint_optimizer,
    require_process_group,
    shard_model,
    world_mesh,
)
from ._fsdp_placement import UnitPlacement
from ._fsdp_prefetch import BACKWARD_PREFETCH_UNSET, prefetch_plan
from ._fsdp_state import (
    FSDPOptimizerWrapper,
    attach_full_state_dict,
    full_optim_state_dict,
    load_full_optimizer,
    save_full_optimizer,
)

__all__ = ["TorchFSDPPlugin", "FSDP1_ONLY_ARGUMENTS"]

#: ColossalAI/FSDP1 arguments with no FSDP2 equivalent: passing any of them raises, naming it.
FSDP1_ONLY_ARGUMENTS = (
    "auto_wrap_policy",
    "ignored_modules",
    "param_init_fn",
    "sync_module_states",
    "fp8_communication",
    "limit_all_gathers",
    "use_orig_params",
)


class TorchFSDPPlugin(Plugin):
    """ZeRO-3 with torch FSDP2: ``fully_shard`` on each block, then on the root.

    Args:
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: FSDP2 ``MixedPrecisionPolicy`` with
            ``param_dtype`` = the precision and fp32 gradient reduction; the sharded fp32 parameters are the
            master weights. ``"fp16"`` adds dynamic loss scaling agreed across ranks.
        reshard_after_forward: free the gathered parameters of a block after its forward (ZeRO-3); ``False``
            keeps them until backward (ZeRO-2-like memory, less communication).
        cpu_offload: ``True`` (or FSDP1's ``CPUOffload(offload_params=True)``) gives ``CPUOffloadPolicy``:
            sharded parameters, gradients and optimizer state on CPU; pinned memory only where an accelerator
            exists.
        sharding_strategy: FSDP1 ``ShardingStrategy`` (or its name) accepted for compatibility: ``FULL_SHARD``
            (reshard after forward) or ``SHARD_GRAD_OP`` (do not); others raise.
        mixed_precision: an FSDP2 ``MixedPrecisionPolicy`` (or FSDP1 ``MixedPrecision`` with ``param_dtype``/
            ``reduce_dtype``), instead of ``precision``.
        shard_modules: which submodules are blocks: a predicate, or module classes; default: the elements of
            ``ModuleList``/``Sequential`` children, else the direct children with parameters.
        max_norm: global-norm gradient clipping inside ``optimizer.step`` (0 = off).
        forward_prefetch: FSDP1's flag: ``True`` makes each unit (root, then each block) all-gather the next
            ``prefetch_blocks`` blocks right after its own all-gather (FSDP2
            ``set_modules_to_forward_prefetch``); ``False`` (default): FSDP2's implicit prefetching.
        backward_prefetch: FSDP1's ``BackwardPrefetch.BACKWARD_PRE``/``BACKWARD_POST`` (or the name): each unit
            all-gathers the ``prefetch_blocks`` preceding blocks before its gradient computation (FSDP2
            ``set_modules_to_backward_prefetch``; FSDP2 has only this pre-backward point, so ``BACKWARD_POST``
            maps to it too); ``None``: no backward prefetching (one block gathered at a time). Not given:
            FSDP2's default, the previous block.
        prefetch_blocks: (stepforge) how many neighbouring blocks are prefetched where prefetching is on
            (default 1; more overlaps more communication and holds that many more blocks gathered). Above 1,
            backward prefetching is explicit even when ``backward_prefetch`` is not given. Blocks are taken in
            registration order, the forward order of a ``ModuleList``/``Sequential`` stack.
        device: compute device (default ``cuda:LOCAL_RANK`` or CPU).

    Raises:
        TypeError: an FSDP1-only argument without an FSDP2 equivalent (``auto_wrap_policy``,
            ``limit_all_gathers``... see ``FSDP1_ONLY_ARGUMENTS``) or an unknown one.
        ValueError: an unknown precision, sharding strategy or ``backward_prefetch``, or ``prefetch_blocks`` < 1.
    """

    name = "torch_fsdp"
    builds_optimizer_config = True
    materializes_meta_model = True
    #: the precision when none is given (the Booster's ``mixed_precision`` may replace it)
    DEFAULT_PRECISION = "fp32"
    #: what the prepared model's ``state_dict()`` gives: the full state on every rank (FSDP1's default)
    FULL_STATE_DICT_RANK_0_ONLY = False

    def __init__(
        self,
        precision: str | None = None,
        reshard_after_forward: bool | None = None,
        cpu_offload: Any = False,
        sharding_strategy: Any = None,
        mixed_precision: Any = None,
        shard_modules: Callable[[nn.Module], bool] | Iterable[type] | None = None,
        max_norm: float = 0.0,
        forward_prefetch: bool = False,
        backward_prefetch: Any = BACKWARD_PREFETCH_UNSET,
        *,
        prefetch_blocks: int = 1,
        device: str | torch.device | None = None,
        process_group: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device, precision=precision, default_precision=self.DEFAULT_PRECISION)
        for key in kwargs:
            if key in FSDP1_ONLY_ARGUMENTS:
                raise TypeError(
                    f"{type(self).__name__}: argument {key!r} is FSDP1's and has no FSDP2 (fully_shard) "
                    "equivalent here; remove it (blocks are chosen with shard_modules; prefetching is "
                    "forward_prefetch/backward_prefetch/prefetch_blocks)."
                )
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}: unexpected argument(s) {', '.join(map(repr, sorted(kwargs)))}."
            )
        if process_group is not None:
            raise TypeError(
                f"{type(self).__name__}: process_group is not supported; the plugin shards over the default "
                "(world) group."
            )
        if sharding_strategy is not None:
            name = (
                sharding_strategy.name
                if isinstance(sharding_strategy, ShardingStrategy)
                else sharding_strategy
            )
            if name == "FULL_SHARD":
                reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
            elif name == "SHARD_GRAD_OP":
                reshard_after_forward = False if reshard_after_forward is None else reshard_after_forward
            else:
                raise ValueError(
                    f"{type(self).__name__}: sharding_strategy {name!r} has no mapping; use 'FULL_SHARD' or "
                    "'SHARD_GRAD_OP' (HSDP: a 2-D mesh is not offered by this plugin)."
                )
        self.reshard_after_forward = True if reshard_after_forward is None else bool(reshard_after_forward)
        if isinstance(cpu_offload, bool):
            self.cpu_offload = cpu_offload
        elif isinstance(cpu_offload, CPUOffload):
            self.cpu_offload = bool(cpu_offload.offload_params)
        else:
            raise TypeError(
                f"{type(self).__name__}: cpu_offload must be a bool or CPUOffload, got {cpu_offload!r}."
            )
        if mixed_precision is not None and not isinstance(
            mixed_precision, MixedPrecisionPolicy | FSDP1Precision
        ):
            raise TypeError(
                f"{type(self).__name__}: mixed_precision must be an FSDP2 MixedPrecisionPolicy or FSDP1's "
                f"MixedPrecision, got {type(mixed_precision).__name__}; or pass precision='bf16'/'fp16'."
            )
        self._mp_override = mixed_precision
        self.shard_modules = shard_modules
        if max_norm < 0:
            raise ValueError(f"{type(self).__name__}: max_norm must be >= 0, got {max_norm!r}.")
        self.max_norm = float(max_norm)
        self.norm_type = 2.0
        #: FSDP2 explicit prefetching from ``forward_prefetch``/``backward_prefetch``/``prefetch_blocks``
        self.prefetch = prefetch_plan(
            type(self).__name__, forward_prefetch, backward_prefetch, prefetch_blocks
        )
        self.default_optimizer: str | None = None

    def supported_precisions(self) -> list[str]:
        return list(PLUGIN_PRECISIONS)

    def control_precision(self) -> bool:
        """``True``: FSDP2's ``MixedPrecisionPolicy`` applies the precision (and fp16 loss scaling here)."""
        return True

    # -- policies ------------------------------------------------------------------------------------------
    def _mp_policy(self) -> Any:
        override = self._mp_override
        if override is None:
            return precision_policy(self.precision or self.DEFAULT_PRECISION)
        if isinstance(override, MixedPrecisionPolicy):
            return override
        return MixedPrecisionPolicy(param_dtype=override.param_dtype, reduce_dtype=override.reduce_dtype)

    def _offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if not self.cpu_offload:
            return OffloadPolicy()
        return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())  # pinning needs one

    def _make_scaler(self) -> DynamicLossScaler | None:
        if self.precision != "fp16":
            return None
        return DynamicLossScaler(process_group=dist.group.WORLD)

    def _placement(self, model: nn.Module, blocks: list[nn.Module]) -> dict[int, UnitPlacement] | None:
        """Per-unit placement (sharded/replicated, offloaded); ``None``: every unit sharded over the world
        with :meth:`_offload_policy` (``gemini`` plans from its fractions)."""
        return None

    def _meshes(self) -> tuple[Any, Any]:
        """``(shard_mesh, replicate_mesh)``: here the 1-D world mesh (nothing is replicated)."""
        return world_mesh(self.device), None

    # -- prepare -------------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Any = None, **kwargs: Any) -> tuple[nn.Module, Any]:
        """Shard ``model`` (moved to the device first) and point ``optimizer`` at the sharded parameters.

        A model with meta tensors (:class:`~stepforge.strategy.LazyInitContext`, ``torch.device("meta")``) is
        sharded on the meta device and only this rank's shards are materialised, with the values of an eager
        build (:mod:`stepforge.strategy.lazy`).

        ``optimizer`` may also be a config dict (``build_optimizer``), built on the sharded parameters. It
        comes back as an :class:`OptimizerWrapper` (loss scaling for fp16, ``max_norm`` clipping).
        """
        require_process_group(type(self).__name__)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{type(self).__name__}.prepare: model must be a torch.nn.Module, got {type(model).__name__}."
            )
        names = param_names(model)
        # a lazy model is sharded on the meta device, then only this rank's shards are materialised
        lazy = lazy_state_names(model) if has_meta_tensors(model) else None
        self.bind_device()
        if lazy is None:
            model.to(self.device)
        shard_mesh, replicate_mesh = self._meshes()
        shard_model(
            model,
            blocks=self.shard_modules,
            mesh=shard_mesh,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self._mp_policy(),
            offload_policy=self._offload_policy(),
            placement=self._placement,
            replicate_mesh=replicate_mesh,
            prefetch=self.prefetch,
        )
        if lazy is not None:
            materialize_model(model, self.device, record=lazy)
        attach_full_state_dict(model, only_rank_0=self.FULL_STATE_DICT_RANK_0_ONLY)
        if optimizer is None:
            return model, None
        if isinstance(optimizer, Mapping):
            cfg = dict(optimizer)
            if self.default_optimizer is not None:
                cfg.setdefault("type", self.default_optimizer)
            optimizer = build_optimizer(cfg, model.parameters())
        else:
            repoint_optimizer(optimizer, names, model)
        return model, self._wrap(model, optimizer)

    def _wrap(self, model: nn.Module, optimizer: Any) -> FSDPOptimizerWrapper:
        return FSDPOptimizerWrapper(
            optimizer,
            model=model,
            scaler=self._make_scaler(),
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            clip_fn=lambda max_norm, norm_type: self.clip_grad_norm_(model, optimizer, max_norm, norm_type),
        )

    def clip_grad_norm_(
        self, model: nn.Module | None, optimizer: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Global-norm clipping over every gradient of ``optimizer``, whatever mesh its unit uses (sharded,
        replicated, HSDP); returns the total norm as a plain tensor."""
        params = [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]
        return clip_grad_norm_by_mesh(params, max_norm, norm_type)

    def full_optim_state_dict(
        self, model: nn.Module, optimizer: Any, rank0_only: bool = True
    ) -> dict[str, Any]:
        """FSDP1's ``FullyShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=True)``: the full,
        unflattened optimizer state keyed by parameter FQN, on rank 0 (``{}`` elsewhere) or on every rank.
        Collective. Through torch's ``get_optimizer_state_dict(..., StateDictOptions(full_state_dict=True))``."""
        return full_optim_state_dict(model, optimizer, rank0_only=rank0_only)

    def save_full_optimizer(
        self, model: nn.Module, optimizer: Any, checkpoint: str | os.PathLike[str]
    ) -> None:
        """The unsharded optimizer save of ColossalAI's FSDP checkpoint IO: :meth:`full_optim_state_dict` in
        one ``torch.save`` file (rank 0 writes; collective). ``Booster.save_optimizer`` writes sharded DCP."""
        save_full_optimizer(model, optimizer, checkpoint)

    def load_full_optimizer(
        self, model: nn.Module, optimizer: Any, checkpoint: str | os.PathLike[str]
    ) -> None:
        """Load a :meth:`save_full_optimizer` file at any world size (each rank keeps its shard; collective)."""
        load_full_optimizer(model, optimizer, checkpoint)

    def memory_plan(
        self,
        model: nn.Module,
        *,
        world_size: int,
        rank: int = 0,
        optimizer: Mapping[str, Any] | torch.optim.Optimizer | None = None,
        backend: str | None = None,
        device: str | torch.device | None = None,
        accumulation_steps: int = 1,
    ) -> MemoryPlan:
        """What one rank holds and communicates: this plugin's units and placement, each parameter sized as FSDP2
        shards and pads it; accumulating, the unsharded gradients ``no_sync`` keeps through the window
        (:func:`~._memory_plans.fsdp_memory_plan`)."""
        from ._memory_plans import fsdp_memory_plan

        return fsdp_memory_plan(
            self,
            model,
            world_size=world_size,
            rank=rank,
            optimizer=optimizer,
            device=device,
            pin_memory=True,
            accumulation_steps=accumulation_steps,
        )

    def supports_no_sync(self) -> bool:
        return True

    def no_sync(self, model: nn.Module | None, optimizer: Any = None) -> AbstractContextManager[Any]:
        """``set_requires_gradient_sync(False)`` on every FSDP module for the block (the flag is read in
        backward); gradients are reduce-scattered by the first backward outside."""
        return fsdp2_no_sync(model)

    def prepare_dataloader(
        self, dataset: Any, batch_size: int, *args: Any, **kwargs: Any
    ) -> StatefulDataLoader:
        """ColossalAI's ``prepare_dataloader`` (:meth:`stepforge.core.Plugin.prepare_dataloader`: this
        rank's ``DistributedSampler`` share), returned as a :class:`~stepforge.strategy.StatefulDataLoader`."""
        return StatefulDataLoader(super().prepare_dataloader(dataset, batch_size, *args, **kwargs))
