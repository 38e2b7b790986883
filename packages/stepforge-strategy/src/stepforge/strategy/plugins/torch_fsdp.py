# SPDX-License-Identifier: Apache-2.0
"""``torch_fsdp`` (aliases ``fsdp``, ``TorchFSDPPlugin``): FSDP2 ``fully_shard`` per block, then the root."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp import MixedPrecision as FSDP1Precision

from stepforge.core import build_optimizer, unwrap_optimizer
from stepforge.core.memory_plan import (
    GatheredUnit,
    MemoryPlan,
    add_optimizer_state,
    check_accumulation_steps,
    summed_grads_lifetime,
    tensor_bytes,
)
from stepforge.core.precision import PLUGIN_PRECISIONS, DynamicLossScaler, get_precision
from stepforge.core.torch_compat import dtensor_local, set_instance_state_dict

from .._env import is_distributed
from ..boosted_model import plugin_module
from ..boosted_optimizer import OptimizerWrapper
from ..checkpoint import commit_file, read_torch_file
from ..lazy import has_meta_tensors, lazy_state_names, materialize_model
from ._fsdp_common import (
    BACKWARD_PREFETCH_UNSET,
    UnitPlacement,
    hybrid_meshes,
    plan_placement,
    plan_units,
    prefetch_plan,
    repoint_optimizer,
    shard_model,
    unit_params,
)
from .single import StatefulLoaderPlugin

__all__ = [
    "TorchFSDPPlugin",
    "FSDP1_ONLY_ARGUMENTS",
    "FSDPOptimizerWrapper",
    "full_optim_state_dict",
    "save_full_optimizer",
    "load_full_optimizer",
    "shard_rows",
]

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


# -- the full (gathered) state -------------------------------------------------------------------------------
# FSDP2's own ``nn.Module.state_dict`` holds this rank's DTensor shards, aliasing the live parameters; the
# prepared model's ``state_dict()`` is the full state instead, a fresh snapshot, as FSDP1's
# ``FULL_STATE_DICT`` and ``GeminiDDP.state_dict`` give (torch's ``torch.distributed.checkpoint.state_dict``).


def _options(only_rank_0: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # cpu_offload=True with full_state_dict=True is torch's "rank 0 only": other ranks get an empty dict
    return StateDictOptions(full_state_dict=True, cpu_offload=only_rank_0)


def full_optim_state_dict(model: nn.Module, optimizer: Any, rank0_only: bool = True) -> dict[str, Any]:
    """FSDP1's ``full_optim_state_dict`` on FSDP2: the unsharded optimizer state keyed by parameter FQN, on
    rank 0 (``{}`` elsewhere) with ``rank0_only``, else on every rank. Collective."""
    model = plugin_module(model)  # the boosted ModelWrapper's .module: the FSDP2 model itself
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, unwrap_optimizer(optimizer), options=_options(rank0_only))
    if rank0_only and dist.get_rank() != 0:
        return {}
    return dict(state)


class FSDPOptimizerWrapper(OptimizerWrapper):
    """:class:`OptimizerWrapper` plus the full optimizer state (``state_dict(only_rank_0=...)`` as
    ColossalAI's ``GeminiOptimizer``, :meth:`full_optim_state_dict` as FSDP1)."""

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
    or on every rank (``only_rank_0``). Called with ``nn.Module.state_dict``'s own arguments (a parent,
    torch's DCP helpers) it is the class's: this rank's shards."""
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
    """Write :func:`full_optim_state_dict` (plus ``grad_scaler``) to the file ``checkpoint`` on rank 0, as
    ColossalAI's FSDP checkpoint IO does, through the one checkpoint writer (atomic). Collective."""
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


def shard_rows(dim0: int, shards: int, index: int) -> tuple[int, int]:
    """``(rows, padded_rows)`` of shard ``index`` of ``shards`` of ``dim0`` rows, as FSDP2 cuts it."""
    padded = -(-dim0 // shards)
    rows = max(0, min(padded, dim0 - index * padded))
    return rows, padded


class TorchFSDPPlugin(StatefulLoaderPlugin):
    """ZeRO-3 with torch FSDP2 (the boosted model is the user's model after ``fully_shard``); FSDP1's and
    ColossalAI's arguments map as the README table "GeminiPlugin and TorchFSDPPlugin arguments" says. As
    FSDP1's, ``state_dict()`` is the full state on every rank; :meth:`full_optim_state_dict` is FSDP1's."""

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
        fsdp1 = [key for key in kwargs if key in FSDP1_ONLY_ARGUMENTS]
        if fsdp1:
            raise TypeError(
                f"{type(self).__name__}: argument {fsdp1[0]!r} is FSDP1's and has no FSDP2 (fully_shard) "
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
            if name not in ("FULL_SHARD", "SHARD_GRAD_OP"):
                raise ValueError(
                    f"{type(self).__name__}: sharding_strategy {name!r} has no mapping; use 'FULL_SHARD' or "
                    "'SHARD_GRAD_OP' (HSDP: a 2-D mesh is not offered by this plugin)."
                )
            if reshard_after_forward is None:
                reshard_after_forward = name == "FULL_SHARD"
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
        #: the plan of the last ``boost``: unit FQN -> :class:`UnitPlacement`
        self.placement: dict[str, UnitPlacement] = {}
        #: the placement ``gemini`` sets from its fractions: here every unit sharded, offloaded with cpu_offload
        self.shard_param_frac = 1.0
        self.offload_frac = 1.0 if self.cpu_offload else 0.0
        self.extra_dp_size = 1
        self.pin_memory = True  # offloaded shards pinned where an accelerator exists
        self._scaler_kwargs: Mapping[str, Any] = {}

    def supported_precisions(self) -> list[str]:
        return list(PLUGIN_PRECISIONS)

    def control_precision(self) -> bool:
        """``True``: FSDP2's ``MixedPrecisionPolicy`` applies the precision (and fp16 loss scaling here)."""
        return True

    def _mp_policy(self) -> Any:
        """FSDP2 ``MixedPrecisionPolicy``: params cast to the precision for compute, gradients reduced in fp32,
        the sharded fp32 parameters are the master weights (or ``mixed_precision`` as given)."""
        override = self._mp_override
        if isinstance(override, MixedPrecisionPolicy):
            return override
        if override is not None:
            return MixedPrecisionPolicy(param_dtype=override.param_dtype, reduce_dtype=override.reduce_dtype)
        dtype = get_precision(self.precision or self.DEFAULT_PRECISION).param_dtype
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)

    def _placement(self, model: nn.Module, blocks: list[nn.Module]) -> dict[int, UnitPlacement]:
        plan = plan_placement(
            model, blocks, shard_param_frac=self.shard_param_frac, offload_frac=self.offload_frac
        )
        self.placement = {unit.name: unit for unit in plan.values()}
        return plan

    # -- prepare -------------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Any = None, **kwargs: Any) -> tuple[nn.Module, Any]:
        """Shard ``model`` and point ``optimizer`` (or build a config dict) on the sharded parameters; a model
        with meta tensors is sharded on the meta device and only this rank's shards are materialised."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        if not is_distributed():
            raise RuntimeError(
                f"{type(self).__name__} needs an initialised process group (torchrun, or "
                "torch.distributed.init_process_group); on one process use plugin='single'."
            )
        names = {id(p): name for name, p in model.named_parameters()}
        # a lazy model is sharded on the meta device, then only this rank's shards are materialised
        lazy = lazy_state_names(model) if has_meta_tensors(model) else None
        self.bind_device()
        if lazy is None:
            model.to(self.device)
        offloaded = shard_model(
            model,
            blocks=self.shard_modules,
            placement=self._placement,
            meshes=hybrid_meshes(self.device, self.extra_dp_size, replicate=self.shard_param_frac < 1.0),
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self._mp_policy(),
            offload_policy=CPUOffloadPolicy(pin_memory=self.pin_memory and torch.accelerator.is_available()),
            prefetch=self.prefetch,
        )
        if lazy is not None:
            materialize_model(model, self.device, record=lazy, on_host=offloaded)
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
        scaler = None
        if self.precision == "fp16":
            scaler = DynamicLossScaler(**self._scaler_kwargs, process_group=dist.group.WORLD)
        return model, FSDPOptimizerWrapper(
            optimizer,
            model=model,
            scaler=scaler,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            clip_fn=lambda max_norm, norm_type: self.clip_grad_norm_(model, optimizer, max_norm, norm_type),
        )

    def clip_grad_norm_(
        self, model: nn.Module | None, optimizer: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Global-norm clipping whatever mesh each unit uses: each mesh's norm reduced over that mesh, the
        norms combined as plain tensors, every gradient scaled; returns the total norm (a plain fp32
        tensor)."""
        from torch.distributed.tensor import DTensor

        groups: dict[Any, list[torch.Tensor]] = {}
        for g in unwrap_optimizer(optimizer).param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    grad = p.grad
                    key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None
                    groups.setdefault(key, []).append(grad)
        if not groups:
            return torch.zeros(())
        norms = []
        for grads in groups.values():
            norm = nn.utils.get_total_norm(grads, norm_type)
            norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
        total = nn.utils.get_total_norm(norms, norm_type)
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:  # torch's clip_grads_with_norm_ rule, as a float so it multiplies DTensors of any mesh
            with torch.no_grad():
                for grads in groups.values():
                    for grad in grads:
                        grad.mul_(coef)
        return total

    #: FSDP1's ``FullyShardedDataParallel.full_optim_state_dict(model, optim, rank0_only=True)``
    full_optim_state_dict = staticmethod(full_optim_state_dict)
    #: the unsharded optimizer save of ColossalAI's FSDP checkpoint IO (``Booster.save_optimizer`` writes DCP)
    save_full_optimizer = staticmethod(save_full_optimizer)
    load_full_optimizer = staticmethod(load_full_optimizer)

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
        """What one rank holds and communicates with the plugin's units and placement, each parameter sized as
        FSDP2 stores it (dimension 0 cut ``torch.chunk``-style, storage padded); what compute gathers is
        listed per unit, so the estimate lays each beside the activations at that unit's own peak."""
        steps = check_accumulation_steps(accumulation_steps, f"{type(self).__name__}.memory_plan")
        no_sync = steps > 1 and self.supports_no_sync()
        reductions = 1 if no_sync else steps  # per unit and optimizer step; every micro-batch gathers
        grads_lifetime = "grads" if no_sync else summed_grads_lifetime(steps)
        on_cpu = torch.device(device if device is not None else self.device).type == "cpu"
        pinned = self.pin_memory and not on_cpu
        extra_dp_size = self.extra_dp_size
        if world_size % extra_dp_size:
            raise ValueError(
                f"{type(self).__name__}: extra_dp_size={extra_dp_size} does not divide world_size={world_size}."
            )
        policy = self._mp_policy()
        plan = MemoryPlan(
            self.name, world_size, rank, compute_dtype=policy.param_dtype, accumulation_steps=steps
        )
        blocks, _, placement = plan_units(model, self.shard_modules, self._placement)
        units = [*blocks, model]
        plan.offloads = any(unit.offload for unit in placement.values())
        stepped: dict[bool, list[tuple[tuple[int, ...], torch.dtype]]] = {True: [], False: []}
        for unit in units:
            where = placement[id(unit)]
            name, sharded, offload = where.name, where.sharded, where.offload
            params = unit_params(unit, units)
            reshard = self.reshard_after_forward and unit is not model
            shards, replicas = (world_size // extra_dp_size, extra_dp_size) if sharded else (1, world_size)
            index = rank % shards
            place = "host" if offload else "device"
            param_dtype = policy.param_dtype or (params[0].dtype if params else torch.float32)
            reduce_dtype = policy.reduce_dtype or param_dtype
            stored = padded_numel = local_numel = full = unsharded = 0
            for p in params:
                rest = p[0].numel() if p.dim() else 1
                rows, padded = shard_rows(p.shape[0] if p.dim() else 1, shards, index)
                stored += padded * rest * p.element_size()
                padded_numel += padded * rest
                local_numel += rows * rest
                full += shards * padded * rest
                if p.requires_grad:
                    unsharded += p.numel()
                    shape = (rows, *p.shape[1:]) if p.dim() else ()
                    stepped[offload].append((shape, p.dtype))
            gathered = tensor_bytes(full, param_dtype)
            plan.units.append(
                GatheredUnit(
                    name=name,
                    gathered=gathered,
                    gather_buffer=gathered if shards > 1 else 0,
                    grads=tensor_bytes(unsharded, param_dtype),
                    reduce=tensor_bytes(full, reduce_dtype),
                    sharded_grads=0 if offload else tensor_bytes(padded_numel, reduce_dtype),
                    resharded=reshard,
                )
            )
            if not params:
                continue
            label = f"unit {name or '<root>'}"
            plan.add("params", place, stored, "sharded parameters (padded)", pinned=offload and pinned)
            # gradients are views of the unit's padded reduce-scatter output; offloaded from an accelerator, each
            # is copied to the CPU unpadded (on a CPU device that copy is the view itself)
            grad_bytes = tensor_bytes(local_numel if offload and not on_cpu else padded_numel, reduce_dtype)
            plan.add("grads", place, grad_bytes, "sharded gradients", grads_lifetime)
            if no_sync:  # set_requires_gradient_sync(False): each unsharded gradient kept in the reduce dtype
                plan.add(
                    "grads",
                    "device",
                    tensor_bytes(unsharded, reduce_dtype),
                    "unsharded gradients (no_sync)",
                    "window",
                )
            gather_bytes = steps * gathered
            plan.collective("all_gather", "forward", steps, gather_bytes, shards, f"{label} parameters")
            if reshard:
                plan.collective("all_gather", "backward", steps, gather_bytes, shards, f"{label} parameters")
            plan.collective(
                "reduce_scatter", "backward", reductions, reductions * tensor_bytes(full, reduce_dtype), shards,
                f"{label} grads",
            )  # fmt: skip
            plan.collective(
                "all_reduce", "backward", reductions, reductions * tensor_bytes(padded_numel, reduce_dtype),
                replicas, f"{label} grads",
            )  # fmt: skip
        buffers = sum(
            tensor_bytes(
                b.numel(), policy.param_dtype if b.is_floating_point() and policy.param_dtype else b.dtype
            )
            for b in model.buffers()
        )
        plan.add("buffers", "device", buffers, "model buffers")
        if optimizer is not None:
            config = optimizer  # an instance is the optimizer the plugin keeps
            if isinstance(optimizer, Mapping) and self.default_optimizer is not None:
                config = {"type": self.default_optimizer, **optimizer}
            for offload, shapes in stepped.items():
                if shapes:
                    add_optimizer_state(plan, config, shapes, place="host" if offload else "device")
        plan.notes.append(f"{len(units)} units")
        if steps > 1:
            plan.notes.append(f"{steps} micro-batches per step, gradients reduced {reductions}x")
        return plan

    # no_sync is core's: set_requires_gradient_sync(False) on every FSDP module for the block
