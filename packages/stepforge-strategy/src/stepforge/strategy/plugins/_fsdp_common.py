# SPDX-License-Identifier: Apache-2.0
"""FSDP2 units of ``torch_fsdp`` and ``gemini``: which modules are sharded one by one, where each lives, which
neighbours it prefetches, and the optimizer re-pointed at the sharded parameters. Gemini places parameter
chunks, FSDP2 ``fully_shard`` units, so the plan walks the units in parameter order and counts bytes, sharding
and offloading from the front as Gemini does."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from stepforge.core import CachingOptimizer
from stepforge.core.torch_compat import tree_flatten

__all__ = [
    "BACKWARD_PREFETCH_UNSET",
    "OutsideReadGuard",
    "PrefetchPlan",
    "UnitPlacement",
    "blocks_read_outside",
    "default_blocks",
    "hybrid_meshes",
    "leading_units",
    "offloaded_names",
    "plan_placement",
    "plan_units",
    "prefetch_plan",
    "repoint_optimizer",
    "shard_model",
    "unit_params",
]


@dataclass(frozen=True)
class UnitPlacement:
    """One ``fully_shard`` unit (``name``: its FQN, ``""`` for the root) and where it lives: ``sharded``, else
    replicated on every rank (as Gemini's kept-gathered chunks); ``offload``: ``CPUOffloadPolicy``."""

    name: str
    param_bytes: int
    sharded: bool
    offload: bool


class _FSDP2Default:
    def __repr__(self) -> str:  # a readable default in signatures and docs
        return "<FSDP2 default>"


#: ``backward_prefetch`` not given: FSDP2's own backward prefetching (the previous block, like FSDP1's
#: ``BACKWARD_PRE``), distinct from an explicit ``None`` (FSDP1: no backward prefetching).
BACKWARD_PREFETCH_UNSET: Any = _FSDP2Default()


@dataclass(frozen=True)
class PrefetchPlan:
    """Neighbouring blocks each unit all-gathers ahead, ``forward`` (0: FSDP2's default) and ``backward``
    (``None``: FSDP2's default, the previous block; 0: none)."""

    forward: int = 0
    backward: int | None = None


def prefetch_plan(
    owner: str, forward_prefetch: Any, backward_prefetch: Any, prefetch_blocks: Any
) -> PrefetchPlan:
    """FSDP1's ``forward_prefetch``/``backward_prefetch`` (``BACKWARD_PRE`` and ``BACKWARD_POST`` both map to
    FSDP2's one pre-backward point) and ``prefetch_blocks`` as a :class:`PrefetchPlan`."""
    if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int) or prefetch_blocks < 1:
        raise ValueError(
            f"{owner}: prefetch_blocks must be an int >= 1 (blocks all-gathered ahead), got {prefetch_blocks!r}; "
            "turn prefetching off with forward_prefetch=False / backward_prefetch=None."
        )
    if not isinstance(forward_prefetch, bool):
        raise TypeError(f"{owner}: forward_prefetch must be a bool, got {forward_prefetch!r}.")
    forward = prefetch_blocks if forward_prefetch else 0
    if backward_prefetch is BACKWARD_PREFETCH_UNSET:
        backward = prefetch_blocks if prefetch_blocks > 1 else None
    elif backward_prefetch is None:
        backward = 0
    else:
        name = (
            backward_prefetch.name if isinstance(backward_prefetch, BackwardPrefetch) else backward_prefetch
        )
        if name not in ("BACKWARD_PRE", "BACKWARD_POST"):
            raise ValueError(
                f"{owner}: backward_prefetch must be BackwardPrefetch.BACKWARD_PRE/BACKWARD_POST (or its name) or "
                f"None, got {backward_prefetch!r}."
            )
        backward = prefetch_blocks
    return PrefetchPlan(forward=forward, backward=backward)


def _apply_prefetch(root: Any, units: list[Any], plan: PrefetchPlan) -> None:
    """Set FSDP2 explicit prefetching on ``root`` and its sharded blocks ``units`` (in forward order)."""
    if plan.forward:
        root.set_modules_to_forward_prefetch(units[: plan.forward])
        for i, unit in enumerate(units):
            ahead = units[i + 1 : i + 1 + plan.forward]
            if ahead:
                unit.set_modules_to_forward_prefetch(ahead)
    if plan.backward == 0:
        # each unit prefetching itself is a no-op (it is gathered by then); an empty list means FSDP2's default
        for unit in [root, *units]:
            unit.set_modules_to_backward_prefetch([unit])
    elif plan.backward is not None:
        root.set_modules_to_backward_prefetch(units[::-1][: plan.backward])
        for i, unit in enumerate(units):
            behind = units[max(0, i - plan.backward) : i][::-1]
            if behind:
                unit.set_modules_to_backward_prefetch(behind)


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of every ``ModuleList``/``Sequential`` holding parameters, else the direct children that
    do."""
    blocks: list[nn.Module] = []
    for module in model.modules():
        if module is not model and isinstance(module, nn.ModuleList | nn.Sequential):
            blocks.extend(m for m in module.children() if any(True for _ in m.parameters()))
    if not blocks:
        blocks = [m for m in model.children() if any(True for _ in m.parameters())]
    # keep the innermost-first order fully_shard wants and drop blocks met twice (modules hash by identity)
    return list(dict.fromkeys(blocks))


def unit_params(unit: nn.Module, units: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters ``unit`` owns: its own, less those of the other ``units`` nested inside it."""
    inside = {id(m) for m in unit.modules() if m is not unit}
    skip = {id(p) for m in units if id(m) in inside for p in m.parameters()}
    return list({id(p): p for p in unit.parameters() if id(p) not in skip}.values())


def leading_units(sizes: list[int], frac: float) -> list[bool]:
    """Which units, taken from the front, cover ``frac`` of the total bytes (Gemini takes chunks until the
    bytes taken reach it; ``frac=1``: all, empty ones included)."""
    goal, taken, out = frac * sum(sizes), 0, []
    for size in sizes:
        take = frac >= 1.0 or (frac > 0 and taken < goal)
        out.append(take)
        taken += size if take else 0
    return out


def plan_placement(
    model: nn.Module, blocks: list[nn.Module], *, shard_param_frac: float = 1.0, offload_frac: float = 0.0
) -> dict[int, UnitPlacement]:
    """Plan ``model``'s units (``blocks`` and the root, keyed by ``id``) in parameter order: the leading ones
    holding ``shard_param_frac`` of the bytes sharded, the rest replicated (Gemini keeps the trailing chunks
    gathered); of the sharded ones, the leading ones holding ``offload_frac`` of all bytes offloaded."""
    order = {id(p): i for i, p in enumerate(model.parameters())}
    units = [*blocks, model]
    owned = {id(u): unit_params(u, units) for u in units}
    names = {id(m): n for n, m in model.named_modules()}
    ranked = sorted(units, key=lambda u: min((order[id(p)] for p in owned[id(u)]), default=len(order)))
    sizes = [sum(p.numel() * p.element_size() for p in owned[id(u)]) for u in ranked]
    # the offload budget counts all bytes, but only sharded units can take it
    goal, taken = offload_frac * sum(sizes), 0
    plan: dict[int, UnitPlacement] = {}
    for unit, size, shard in zip(ranked, sizes, leading_units(sizes, shard_param_frac), strict=True):
        offload = shard and (offload_frac >= 1.0 or (offload_frac > 0 and taken < goal))
        taken += size if offload else 0
        plan[id(unit)] = UnitPlacement(names[id(unit)], size, shard, offload)
    return plan


def hybrid_meshes(device: torch.device, extra_dp_size: int, *, replicate: bool) -> tuple[Any, Any]:
    """``(shard_mesh, replicate_mesh)``: ``(world,)`` or the HSDP mesh for ``extra_dp_size`` > 1; ``(world,
    1)`` only when ``replicate`` (its process groups cost a collective set-up), else ``None``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % extra_dp_size != 0:
        raise ValueError(
            f"GeminiPlugin: extra_dp_size={extra_dp_size} does not divide the world size {world}; pick a "
            f"divisor of {world}."
        )
    names = ("replicate", "shard")
    if extra_dp_size == 1:
        shard_mesh = init_device_mesh(device.type, (world,))
    else:
        shard_mesh = init_device_mesh(
            device.type, (extra_dp_size, world // extra_dp_size), mesh_dim_names=names
        )
    replicate_mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=names) if replicate else None
    return shard_mesh, replicate_mesh


def plan_units(
    model: nn.Module,
    blocks: Callable[[nn.Module], bool] | Iterable[type] | None,
    placement: Callable[[nn.Module, list[nn.Module]], Mapping[int, UnitPlacement]],
) -> tuple[list[nn.Module], set[int] | None, Mapping[int, UnitPlacement]]:
    """``(blocks, read_outside, plan)`` without changing ``model``: ``blocks`` resolved, less those with a
    parameter also registered outside them (tied weights stay in the root unit) and those the forward reads
    outside them (``read_outside``; ``None``: untraceable), and ``placement``'s plan."""
    if blocks is None:
        chosen = default_blocks(model)
    elif callable(blocks) and not isinstance(blocks, type):
        chosen = [m for m in model.modules() if m is not model and blocks(m)]
    else:
        classes = tuple(cast(Iterable[type], blocks))  # a class is callable: the branch above excludes it
        chosen = [m for m in model.modules() if m is not model and isinstance(m, classes)]
    owners: dict[int, list[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(id(module))

    def tied(block: nn.Module) -> bool:
        inside = {id(m) for m in block.modules()}
        return any(owner not in inside for p in block.parameters() for owner in owners[id(p)])

    chosen = [block for block in chosen if not tied(block)]
    read_outside = blocks_read_outside(model, chosen)
    if read_outside is not None:
        chosen = [block for block in chosen if id(block) not in read_outside]
    return chosen, read_outside, placement(model, chosen)


def shard_model(
    model: nn.Module,
    *,
    blocks: Callable[[nn.Module], bool] | Iterable[type] | None,
    placement: Callable[[nn.Module, list[nn.Module]], Mapping[int, UnitPlacement]],
    meshes: tuple[Any, Any],
    reshard_after_forward: bool,
    mp_policy: Any,
    offload_policy: Any,
    prefetch: PrefetchPlan,
) -> set[str]:
    """``fully_shard`` each block of :func:`plan_units` (innermost first), then the root, on the mesh and
    offload policy its placement names; then ``prefetch``. Floating buffers are cast to the compute dtype
    first: FSDP2 casts only parameters, so a BatchNorm would meet bf16 weights and fp32 statistics (ColossalAI
    casts buffers too). Returns the names of the parameters offloaded to the host (:func:`offloaded_names`)."""
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return set()
    chosen, read_outside, plan = plan_units(model, blocks, placement)
    offloaded = offloaded_names(model, chosen, plan)
    dtype = mp_policy.param_dtype
    for module in model.modules() if dtype is not None else ():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, name, buffer.to(dtype))  # setattr keeps it registered (persistent or not)
    for module, reshard in [*((b, reshard_after_forward) for b in reversed(chosen)), (model, False)]:
        unit = plan[id(module)]
        fully_shard(
            module,
            mesh=meshes[0] if unit.sharded else meshes[1],
            reshard_after_forward=reshard,
            mp_policy=mp_policy,
            offload_policy=offload_policy if unit.offload else OffloadPolicy(),
        )
    if prefetch != PrefetchPlan():
        _apply_prefetch(model, [b for b in chosen if isinstance(b, FSDPModule)], prefetch)
    if read_outside is None and chosen:
        names = {id(p) for b in chosen for p in b.parameters()}
        OutsideReadGuard(model, {n for n, p in model.named_parameters() if id(p) in names})
    return offloaded


def offloaded_names(model: nn.Module, chosen: list[nn.Module], plan: Mapping[int, UnitPlacement]) -> set[str]:
    """The names (as ``model.named_parameters()`` gives them) of the parameters of the units ``plan`` offloads
    (:func:`unit_params`). A lazy model's offloaded shards are materialised on the host: FSDP2 refuses
    CPU-offloaded parameters anywhere else."""
    units = [*chosen, model]
    host = {id(p) for u in units if plan[id(u)].offload for p in unit_params(u, units)}
    return {name for name, p in model.named_parameters() if id(p) in host}


def repoint_optimizer(optimizer: Any, before: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer``'s groups at ``model``'s sharded parameters, matched by FQN (``before``: id ->
    FQN)."""
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


# -- blocks whose parameters are read outside their own forward ----------------------------------------------
# A parent reading a child's parameter (``F.linear(x, self.fc1.weight)``) meets it sharded under FSDP2: such
# blocks are found by tracing with ``torch.fx`` and left in the parent's unit; an untraceable forward is watched
# on its first call (OutsideReadGuard), which names the parameter and the fix.


def blocks_read_outside(model: nn.Module, blocks: list[nn.Module]) -> set[int] | None:
    """``id`` of each block whose parameters ``model``'s forward reads outside the block's own forward;
    ``None`` when the forward cannot be traced."""
    import torch.fx

    if not blocks:
        return set()
    block_ids = {id(b) for b in blocks}
    named = [n.split(".") for n, m in model.named_modules() if id(m) in block_ids]
    around = {id(model.get_submodule(".".join(parts[:i]))) for parts in named for i in range(len(parts))}

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return id(m) in block_ids or id(m) not in around

    traced = [m for m in model.modules() if id(m) in around]
    # per module: a shallow copy of its attributes, and each own buffer with a copy of its value
    saved = [
        (
            dict(vars(m)),
            {n: (b, b.detach().clone()) for n, b in m.named_buffers(recurse=False) if b is not None},
        )
        for m in traced
    ]
    try:
        graph = _Tracer().trace(model)
    except Exception:  # any trace failure (control flow on values, unsupported ops) means "cannot tell"
        return None
    finally:
        # symbolic tracing still runs what the forward does to real objects: an in-place update of a buffer
        # (``self.seen.add_(1)``) or a Python attribute (``self.calls += 1``); preparing must not train
        with torch.no_grad():
            for m, (attrs, buffers) in zip(traced, saved, strict=True):
                vars(m).clear()
                vars(m).update(attrs)
                for name, (buffer, value) in buffers.items():
                    setattr(
                        m, name, buffer
                    )  # the same tensor object as before (a forward may have rebound it)
                    buffer.copy_(value)
    owner: dict[int, int] = {}
    for block in blocks:
        for p in block.parameters():
            owner.setdefault(id(p), id(block))
    read: set[int] = set()
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            value = model.get_parameter(str(node.target))
        except AttributeError:
            continue  # a buffer or constant
        if id(value) in owner:
            read.add(owner[id(value)])
    return read


class _SeeShardedParams(TorchFunctionMode):
    def __init__(self, sharded: dict[int, str]) -> None:
        super().__init__()
        self.sharded = sharded

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = [
            value for value in tree_flatten((args, kwargs or {}))[0] if isinstance(value, torch.Tensor)
        ]
        # only an op mixing a sharded parameter with a plain tensor fails: FSDP2's own bookkeeping touches the
        # sharded parameters alone (``.data``, ``to_local``...) and must pass
        plain = any(not isinstance(value, DTensor) for value in tensors)
        for value in tensors if plain else ():
            name = self.sharded.get(id(value))
            if name is not None:
                raise RuntimeError(
                    f"parameter {name!r} is read outside the forward of the fully_shard unit that holds it "
                    "(e.g. a parent calling F.linear(x, self.child.weight)); FSDP2 has it sharded there. Boost "
                    "with shard_modules=() (one unit for the whole model) or a shard_modules predicate that "
                    "leaves that module in its parent's unit."
                )
        return func(*args, **(kwargs or {}))


class OutsideReadGuard:
    """Watch ``root``'s first forward (inside FSDP2's hooks, so only the blocks' parameters are sharded): a
    torch op given one of ``block_params`` raises a ``RuntimeError`` naming it and the fix."""

    def __init__(self, root: nn.Module, block_params: set[str]) -> None:
        self._root = root
        self._names = block_params
        self._inner = root.forward
        root.forward = self._watched

    def _watched(self, *args: Any, **kwargs: Any) -> Any:
        self.close()
        sharded = {id(p): n for n, p in self._root.named_parameters() if n in self._names}
        with _SeeShardedParams(sharded):
            return self._inner(*args, **kwargs)

    def close(self) -> None:
        """Stop watching before the first forward (idempotent)."""
        if "forward" in vars(self._root):
            del self._root.forward
