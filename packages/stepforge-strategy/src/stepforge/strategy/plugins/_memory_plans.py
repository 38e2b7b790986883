# SPDX-License-Identifier: Apache-2.0
"""The memory plans of ``torch_ddp``, ``torch_fsdp`` and ``gemini`` (their ``memory_plan`` methods).

``torch_fsdp``/``gemini`` take their units from the code that shards (:func:`~._fsdp_common.plan_units`) and
size each parameter as FSDP2 stores it: dimension 0 cut ``torch.chunk``-style, every rank's storage padded.
What compute gathers is listed per unit (``plan.units``), not as one total: the estimate lays each unit's
beside the activations traced at that unit's own peak. Accumulating, FSDP2 under
``set_requires_gradient_sync(False)`` keeps every unit's unsharded gradient until the window's last backward;
without ``no_sync`` (``gemini``) every micro-batch reduces into the sharded gradients."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stepforge.core.memory_plan import (
    GatheredUnit,
    MemoryPlan,
    add_optimizer_state,
    check_accumulation_steps,
    replicated_plan,
    summed_grads_lifetime,
    tensor_bytes,
    unique_parameters,
)
from stepforge.core.torch_compat import ddp_bucket_assignment

from ._fsdp_common import plan_units, unit_params

if TYPE_CHECKING:
    from .torch_ddp import TorchDDPPlugin
    from .torch_fsdp import TorchFSDPPlugin

__all__ = ["ddp_memory_plan", "fsdp_memory_plan", "shard_rows"]


def shard_rows(dim0: int, shards: int, index: int) -> tuple[int, int]:
    """``(rows, padded_rows)`` of shard ``index`` of ``shards`` of ``dim0`` rows, as FSDP2 (``torch.chunk``)
    cuts it."""
    padded = -(-dim0 // shards)
    rows = max(0, min(padded, dim0 - index * padded))
    return rows, padded


def ddp_memory_plan(
    plugin: TorchDDPPlugin,
    model: nn.Module,
    *,
    world_size: int,
    rank: int = 0,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer | None = None,
    backend: str | None = None,
    device: str | torch.device | None = None,
    accumulation_steps: int = 1,
) -> MemoryPlan:
    """The replicated layout plus DDP's buckets (one copy of the gradients, none with
    ``gradient_as_bucket_view``), all-reduced once per optimizer step."""
    plan = replicated_plan(
        plugin.name,
        model,
        world_size=world_size,
        rank=rank,
        optimizer=optimizer,
        accumulation_steps=accumulation_steps,
    )
    reductions = 1 if plugin.supports_no_sync() else plan.accumulation_steps
    grads = [p for _, p in unique_parameters(model) if p.requires_grad]
    cap = int(plugin.ddp_kwargs["bucket_cap_mb"] * 1024**2)
    buckets = ddp_bucket_assignment(list(reversed(grads)), cap)
    total = sum(p.numel() * p.element_size() for p in grads)
    if not plugin.ddp_kwargs["gradient_as_bucket_view"]:
        plan.add("buffers", "device", total, "DDP gradient buckets")
    plan.collective(
        "all_reduce",
        "backward",
        reductions * len(buckets),
        reductions * total,
        world_size,
        "gradient buckets",
    )
    plan.notes.append(f"{len(buckets)} buckets of <= {plugin.ddp_kwargs['bucket_cap_mb']} MiB")
    if plan.accumulation_steps > 1:
        plan.notes.append(f"{plan.accumulation_steps} micro-batches per step, all-reduced {reductions}x")
    return plan


def fsdp_memory_plan(
    plugin: TorchFSDPPlugin,
    model: nn.Module,
    *,
    world_size: int,
    rank: int = 0,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer | None = None,
    backend: str | None = None,
    device: str | torch.device | None = None,
    accumulation_steps: int = 1,
) -> MemoryPlan:
    """What one rank holds and communicates with the plugin's units and placement; offloaded shards are pinned
    only on an accelerator ``device``, as ``CPUOffloadPolicy`` pins them."""
    steps = check_accumulation_steps(accumulation_steps, f"{type(plugin).__name__}.memory_plan")
    no_sync = steps > 1 and plugin.supports_no_sync()
    reductions = 1 if no_sync else steps  # per unit and optimizer step; every micro-batch gathers
    grads_lifetime = "grads" if no_sync else summed_grads_lifetime(steps)
    on_cpu = torch.device(device if device is not None else plugin.device).type == "cpu"
    pinned = plugin.pin_memory and not on_cpu
    extra_dp_size = plugin.extra_dp_size
    if world_size % extra_dp_size:
        raise ValueError(
            f"{type(plugin).__name__}: extra_dp_size={extra_dp_size} does not divide world_size={world_size}."
        )
    policy = plugin._mp_policy()
    plan = MemoryPlan(
        plugin.name, world_size, rank, compute_dtype=policy.param_dtype, accumulation_steps=steps
    )
    blocks, _, placement = plan_units(model, plugin.shard_modules, plugin._placement)
    units = [*blocks, model]
    plan.offloads = any(unit.offload for unit in placement.values())
    stepped: dict[bool, list[tuple[tuple[int, ...], torch.dtype]]] = {True: [], False: []}
    for unit in units:
        where = placement[id(unit)]
        name, sharded, offload = where.name, where.sharded, where.offload
        params = unit_params(unit, units)
        reshard = plugin.reshard_after_forward and unit is not model
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
        if isinstance(optimizer, Mapping) and plugin.default_optimizer is not None:
            config = {"type": plugin.default_optimizer, **optimizer}
        for offload, shapes in stepped.items():
            if shapes:
                add_optimizer_state(plan, config, shapes, place="host" if offload else "device")
    plan.notes.append(f"{len(units)} units")
    if steps > 1:
        plan.notes.append(f"{steps} micro-batches per step, gradients reduced {reductions}x")
    return plan
