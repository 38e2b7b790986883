# SPDX-License-Identifier: Apache-2.0
"""FSDP2 plumbing shared by ``torch_fsdp`` and ``gemini``: which modules to shard, the optimizer re-pointed at
the sharded (DTensor) parameters, the precision policy."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import CachingOptimizer
from stepforge.core.precision import get_precision

from .._env import is_distributed
from ._fsdp_param_reads import OutsideReadGuard, blocks_read_outside
from ._fsdp_placement import UnitPlacement
from ._fsdp_prefetch import PrefetchPlan, apply_prefetch

__all__ = [
    "shard_model",
    "plan_units",
    "choose_blocks",
    "cast_floating_buffers",
    "precision_policy",
    "repoint_optimizer",
]


def precision_policy(precision: str) -> Any:
    """FSDP2 ``MixedPrecisionPolicy``: params cast to the precision for compute, gradients reduced in fp32,
    the sharded fp32 parameters are the master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = get_precision(precision).param_dtype
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded one by one: the elements of every ``ModuleList``/``Sequential`` child that holds
    parameters; without such containers, the direct children holding parameters."""
    blocks: list[nn.Module] = []
    for module in model.modules():
        if module is model:
            continue
        if isinstance(module, nn.ModuleList | nn.Sequential):
            blocks.extend(m for m in module.children() if any(True for _ in m.parameters()))
    if not blocks:
        blocks = [m for m in model.children() if any(True for _ in m.parameters())]
    # keep the innermost-first order fully_shard wants and drop blocks nested in other blocks' parents twice
    # (modules hash by identity)
    return list(dict.fromkeys(blocks))


def holds_shared_parameters(
    block: nn.Module, model: nn.Module, owners: Mapping[int, list[int]] | None = None
) -> bool:
    """Whether a parameter of ``block`` is also registered on a module of ``model`` outside ``block`` (tied
    weights). Such a block is not sharded on its own: its parameters stay in the enclosing (root) unit, so the
    other module reads the same unsharded tensor instead of meeting a resharded DTensor.

    ``owners`` (optional, from :func:`parameter_owners`): ``id(param)`` -> ids of the modules registering it,
    computed once for many blocks (otherwise every module of ``model`` is walked per block)."""
    if owners is None:
        owners = parameter_owners(model)
    inside = {id(m) for m in block.modules()}
    return any(owner not in inside for p in block.parameters() for owner in owners.get(id(p), ()))


def parameter_owners(model: nn.Module) -> dict[int, list[int]]:
    """``id(param)`` -> the ids of the modules of ``model`` that register it directly."""
    owners: dict[int, list[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(id(module))
    return owners


def cast_floating_buffers(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Cast ``model``'s floating buffers (BatchNorm's running statistics...) to ``dtype``, the compute dtype.

    FSDP2's ``MixedPrecisionPolicy`` casts only the parameters, so a BatchNorm forward would meet bf16/fp16
    weights and fp32 statistics ("expected scalar type"); ColossalAI casts buffers (gemini, FSDP1's
    ``buffer_dtype``). Assigning through ``setattr`` keeps each buffer registered (persistent or not).
    ``None``: full precision, nothing to cast.
    """
    if dtype is None:
        return
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, name, buffer.to(dtype))


def choose_blocks(
    model: nn.Module, blocks: Callable[[nn.Module], bool] | Iterable[type] | None
) -> list[nn.Module]:
    """The modules sharded as their own units: ``blocks`` resolved (``None``: :func:`default_blocks`), less
    those holding parameters tied to a module outside them and those whose parameters the forward reads outside
    their own forward (found by tracing; both stay in the enclosing root unit)."""
    if blocks is None:
        chosen = default_blocks(model)
    elif callable(blocks) and not isinstance(blocks, type):
        chosen = [m for m in model.modules() if m is not model and blocks(m)]
    else:
        classes = tuple(cast(Iterable[type], blocks))  # a class is callable: the branch above excludes it
        chosen = [m for m in model.modules() if m is not model and isinstance(m, classes)]
    owners = parameter_owners(model)
    return [block for block in chosen if not holds_shared_parameters(block, model, owners)]


def plan_units(
    model: nn.Module,
    blocks: Callable[[nn.Module], bool] | Iterable[type] | None,
    placement: Callable[[nn.Module, list[nn.Module]], Mapping[int, UnitPlacement] | None] | None = None,
) -> tuple[list[nn.Module], set[int] | None, Mapping[int, UnitPlacement] | None]:
    """``(blocks, read_outside, plan)``: the modules :func:`shard_model` shards as their own units (see
    :func:`choose_blocks`, less those whose parameters the forward reads outside them), the ids of those found
    read outside (``None``: the forward could not be traced) and ``placement``'s plan. Nothing is changed: the
    memory plan reads the same units."""
    chosen = choose_blocks(model, blocks)
    read_outside = blocks_read_outside(model, chosen)
    if read_outside is not None:
        chosen = [block for block in chosen if id(block) not in read_outside]
    plan = placement(model, chosen) if placement is not None else None
    return chosen, read_outside, plan


def shard_model(
    model: nn.Module,
    *,
    blocks: Callable[[nn.Module], bool] | Iterable[type] | None,
    mesh: Any,
    reshard_after_forward: bool,
    mp_policy: Any,
    offload_policy: Any,
    placement: Callable[[nn.Module, list[nn.Module]], Mapping[int, UnitPlacement] | None] | None = None,
    replicate_mesh: Any = None,
    prefetch: PrefetchPlan | None = None,
) -> nn.Module:
    """Cast floating buffers to the policy's compute dtype, then ``fully_shard`` each block (see
    :func:`choose_blocks`), then the root (one communication group per call).

    ``placement(model, blocks)`` (optional) says per unit whether it is sharded over ``mesh`` or replicated
    over ``replicate_mesh``, and whether it takes ``offload_policy`` (else no offload); without it every unit
    is sharded over ``mesh`` with ``offload_policy``. A block whose parameters the forward reads outside the
    block stays in the root unit; when the forward cannot be traced, the first forward is watched and such a
    read raises an error naming the parameter (:class:`OutsideReadGuard`). ``prefetch`` (optional) sets FSDP2
    explicit prefetching between the root and the sharded blocks (:func:`apply_prefetch`).
    """
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return model
    chosen, read_outside, plan = plan_units(model, blocks, placement)
    cast_floating_buffers(model, mp_policy.param_dtype)

    def _shard(module: nn.Module, reshard: bool) -> None:
        unit = plan[id(module)] if plan is not None else None
        if unit is not None and not unit.sharded and replicate_mesh is None:
            raise ValueError(
                f"shard_model: unit {unit.name!r} is planned replicated but no replicate_mesh was given."
            )
        fully_shard(
            module,
            mesh=mesh if unit is None or unit.sharded else replicate_mesh,
            reshard_after_forward=reshard,
            mp_policy=mp_policy,
            offload_policy=offload_policy if unit is None or unit.offload else OffloadPolicy(),
        )

    for block in reversed(chosen):  # innermost (last registered) first
        _shard(block, reshard_after_forward)
    _shard(model, False)
    if prefetch is not None:
        apply_prefetch(model, chosen, prefetch)
    if read_outside is None and chosen:
        names = {n for b in chosen for n, _ in _named_in(model, b)}
        OutsideReadGuard(model, names)
    return model


def _named_in(model: nn.Module, block: nn.Module) -> list[tuple[str, nn.Parameter]]:
    prefix = next(n for n, m in model.named_modules() if m is block)
    return [(f"{prefix}.{n}", p) for n, p in block.named_parameters()]


def repoint_optimizer(optimizer: Any, before: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer``'s groups at ``model``'s new (sharded) parameters, matched by name.

    ``before`` maps ``id(old parameter)`` to its FQN. The optimizer must not have state yet.
    """
    if optimizer is None:
        return
    if len(optimizer.state) > 0:
        raise ValueError(
            "the optimizer already has state; FSDP2 replaces the parameters with sharded ones, so build the "
            "optimizer before its first step and boost it then (or load its state after boost)."
        )
    after = dict(model.named_parameters())
    for group in optimizer.param_groups:
        new = []
        for p in group["params"]:
            name = before.get(id(p))
            if name is None or name not in after:
                raise ValueError(
                    "the optimizer holds a parameter that is not in the boosted model; build it from "
                    "model.parameters() of the model passed to boost()."
                )
            new.append(after[name])
        group["params"] = new
    if isinstance(optimizer, CachingOptimizer):  # stepforge-fused caches views of the old parameters
        optimizer.invalidate_cache()


def param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def require_process_group(owner: str) -> None:
    if not is_distributed():
        raise RuntimeError(
            f"{owner} needs an initialised process group (torchrun, or torch.distributed.init_process_group); "
            "on one process use plugin='single'."
        )


def world_mesh(device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def clip_grad_norm_by_mesh(params: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """Global-norm clipping over gradients that may live on different meshes (sharded and replicated units,
    HSDP): each mesh's norm is reduced over that mesh, the norms are combined as plain tensors, then every
    gradient is scaled. Returns the total norm (a plain fp32 tensor)."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        key = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    if not groups:
        return torch.zeros(())
    norms = []
    for members in groups.values():
        norm = nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in members], norm_type)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norms.append(norm.float().cpu())
    total = nn.utils.get_total_norm(norms, norm_type)
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:  # torch's clip_grads_with_norm_ rule, as a float so it multiplies DTensors of any mesh
        with torch.no_grad():
            for members in groups.values():
                for p in members:
                    cast(torch.Tensor, p.grad).mul_(coef)
    return total
