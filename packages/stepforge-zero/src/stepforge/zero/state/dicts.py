# SPDX-License-Identifier: Apache-2.0
"""The state dicts of a ``LowLevelZeroOptimizer``: the full one and the sharded one for DCP.

Full (:func:`full_state_dict`, world-size-independent): ``torch.optim``'s layout keyed by the global parameter
index, every per-element state tensor in the parameter's full shape, gathered by one ``all_gather_object``;
``torch.optim.Optimizer.load_state_dict`` ignores the extra ``"zero"`` key, so it also loads into the plain inner
optimizer over the working parameters.

Sharded (:func:`named_state_dict`), the layout every plugin shares: keyed by parameter name, each tensor this
rank's piece as a :class:`stepforge.core.flat_shard.FlatShard` in its parameter's shape, which DCP writes without
gathering and reads the overlap into from whatever was saved (this optimizer at another world size, FSDP2's
``Shard(0)`` DTensors, DDP's replicated tensors). :func:`load_state_dict` also reads the index-keyed layout of
earlier versions (state keyed ``"<index>"``, 1-D tensors of the flattened parameter).

Both carry ``"zero": {"loss_scaler": ..., "skipped_steps": n, "master_weights": {key: tensor}}``, masters only for
parameters whose master is not the working parameter itself (so a move to a plugin with fp32 parameters keeps
their fp32 values). The functions take the :class:`~.partition.ShardLayout`, the inner optimizer and the working
param groups, never the optimizer; the caller waits for reductions in flight and owns the ``"zero"`` extras.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import CachingOptimizer, HyperParameterError
from stepforge.core.flat_shard import FlatShard

from .partition import ShardLayout, Slot

__all__ = [
    "full_state_dict",
    "named_state_dict",
    "load_state_dict",
    "copy_hyperparameters",
    "invalidate_cache",
]

ParamGroups = list[dict[str, Any]]


def invalidate_cache(inner: torch.optim.Optimizer) -> None:
    """Drop ``inner``'s cached tensor lists (after its params or state were swapped); no-op for others."""
    if isinstance(inner, CachingOptimizer):
        inner.invalidate_cache()


def copy_hyperparameters(source: Sequence[Mapping[str, Any]], target: ParamGroups) -> None:
    """Every key but ``"params"`` of each ``source`` group into the matching ``target`` group."""
    for theirs, ours in zip(source, target, strict=True):
        for key, value in theirs.items():
            if key != "params":
                ours[key] = value


def _is_elementwise(key: str, value: Any, slot: Slot) -> bool:
    """Whether a state entry holds one value per element of the parameter (sharded like it)."""
    return torch.is_tensor(value) and key != "step" and value.dim() == 1 and value.numel() == slot.valid > 0


def _group_entries(
    layout: ShardLayout, param_groups: ParamGroups, names: Sequence[Any]
) -> list[dict[str, Any]]:
    """The working ``param_groups`` with each parameter's name (``names[index]``) instead of tensors."""
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[s.index] for s in layout.group_slots(g)],
        }
        for g, group in enumerate(param_groups)
    ]


def full_state_dict(
    layout: ShardLayout, inner: torch.optim.Optimizer, param_groups: ParamGroups, extras: Mapping[str, Any]
) -> dict[str, Any]:
    """The full state dict (see the module docstring); collective over ``layout.group``. ``inner`` steps the
    master pieces (its ``state`` is keyed by ``slot.master``); ``extras``: the ``"zero"`` entries beside the
    masters (``loss_scaler``, ``skipped_steps``)."""
    # masters of every slot in a partition that holds a separate one, as the partition is gathered as a whole
    with_master = {
        s.index
        for part in layout.partitions
        if any(x.separate_master for x in part.slots)
        for s in part.slots
    }
    local: dict[int, tuple[int, dict[str, Any], torch.Tensor | None]] = {}
    for slot in layout.slots:
        state = (inner.state.get(slot.master) if slot.valid else None) or {}
        entry = {
            key: (
                _is_elementwise(key, value, slot),
                value.detach().cpu().clone() if torch.is_tensor(value) else value,
            )
            for key, value in state.items()
        }
        master = slot.master.detach().cpu().clone() if slot.index in with_master and slot.valid else None
        if entry or master is not None:
            local[slot.index] = (slot.start, entry, master)
    everyone: list[Any] = [local]
    if layout.world_size > 1:  # one object gather: each rank's pieces, in rank order
        everyone = [None] * layout.world_size
        dist.all_gather_object(everyone, local, group=layout.group)
    state_out: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    for slot in layout.slots:
        for start, entry, master in (rank[slot.index] for rank in everyone if slot.index in rank):
            # per parameter, the first holder's key order (torch's Adam: step, exp_avg, exp_avg_sq), as torch.optim
            # and ColossalAI list them; a rank without a piece's state contributes zeros
            out = state_out.setdefault(slot.index, {}) if entry else {}
            for key, (elementwise, value) in entry.items():
                if elementwise:
                    full = out.setdefault(key, value.new_zeros(slot.param.shape))
                    full.view(-1)[start : start + value.numel()].copy_(value)
                else:
                    out.setdefault(key, value)
            if master is not None:
                full = masters.setdefault(slot.index, master.new_zeros(slot.param.shape))
                full.view(-1)[start : start + master.numel()].copy_(master)
        if slot.index in with_master and slot.index not in masters:
            masters[slot.index] = torch.zeros(slot.param.shape, dtype=slot.master.dtype)
    indices = [s.index for s in layout.slots]
    return {
        "state": state_out,
        "param_groups": _group_entries(layout, param_groups, indices),
        "zero": {**extras, "master_weights": masters},
    }


# -- sharded, by name ------------------------------------------------------------------------------------
@torch.no_grad()
def _throwaway_step(
    inner: torch.optim.Optimizer, groups: list[list[torch.Tensor]]
) -> dict[int, dict[str, Any]]:
    """One step of a shallow copy of ``inner`` (its own groups and state, lr 0) over zero copies of ``groups``
    (one list per param group), zero gradients; ``id(given tensor)`` -> the state entry its copy got.
    ``inner``, the given tensors and their gradients are never touched."""
    proxies: dict[int, torch.Tensor] = {}
    copies = []
    for group, params in zip(inner.param_groups, groups, strict=True):
        mine = []
        for tensor in params:
            proxy = torch.zeros_like(tensor, requires_grad=True)
            proxy.grad = torch.zeros_like(tensor)
            proxies[id(tensor)] = proxy
            mine.append(proxy)
        options = {k: v for k, v in group.items() if k != "params"}
        options["lr"] = group["lr"] * 0.0 if torch.is_tensor(group["lr"]) else 0.0
        copies.append({**options, "params": mine})
    # a shallow copy with its own groups and state: the class's step (never an instance-patched ``step``, as an
    # lr scheduler installs) runs on the zero copies only
    throwaway = copy.copy(inner)
    throwaway.param_groups = copies
    throwaway.state = collections.defaultdict(dict)
    try:
        type(inner).step(throwaway)
    finally:
        invalidate_cache(inner)  # a cache the copy shares may have seen the copies' tensors
    return {key: dict(throwaway.state[proxy]) for key, proxy in proxies.items() if proxy in throwaway.state}


def named_state_dict(
    layout: ShardLayout,
    inner: torch.optim.Optimizer,
    param_groups: ParamGroups,
    names: Sequence[str],
    extras: Mapping[str, Any],
) -> dict[str, Any]:
    """The sharded state dict (see the module docstring); ``names``: each parameter's name by global index. No
    collectives. A never-stepped optimizer is laid out by a throwaway step, never stepped."""
    if len(names) != len(layout.slots):
        raise HyperParameterError(
            f"LowLevelZeroOptimizer.sharded_state_dict: {len(names)} names for {len(layout.slots)} parameters; "
            "pass one name per parameter, in param-group order."
        )
    if inner.state:
        entries = dict(inner.state)
    else:
        made = _throwaway_step(inner, [list(g["params"]) for g in inner.param_groups])
        entries = {m: made[id(m)] for g in inner.param_groups for m in g["params"] if id(m) in made}
    # per param group, a state entry to mirror for the parameters this rank holds nothing of: one of its own, or
    # for a group of which this rank holds no piece with state, that of a one-element throwaway step (every rank
    # then lists the same entries, so a gather of them is the same on every rank)
    templates: dict[int, dict[str, Any]] = {}
    for slot in layout.slots:
        if slot.valid and entries.get(slot.master):
            templates.setdefault(slot.group, dict(entries[slot.master]))
    missing = {s.group for s in layout.slots} - set(templates)
    if missing:
        device, dtype = layout.master_device, layout.slots[0].master.dtype
        probes = [
            [torch.zeros(1, device=device, dtype=dtype)] if g in missing else []
            for g in range(len(inner.param_groups))
        ]
        got = _throwaway_step(inner, probes)
        templates.update({g: got[id(probes[g][0])] for g in missing if id(probes[g][0]) in got})
    state: dict[str, dict[str, Any]] = {}
    for slot in layout.slots:
        entry = entries.get(slot.master) if slot.valid else None
        if entry is None and not slot.valid and slot.group in templates:
            # this rank owns nothing of a tiny parameter: an empty piece under the same keys
            entry = {
                k: v.new_empty(0) if torch.is_tensor(v) and v.dim() == 1 and k != "step" else v
                for k, v in templates[slot.group].items()
            }
            elementwise = {k for k, v in entry.items() if torch.is_tensor(v) and v.dim() == 1 and k != "step"}
        elif entry is not None:
            elementwise = {k for k, v in entry.items() if _is_elementwise(k, v, slot)}
        else:
            continue
        shape = slot.param.shape
        state[names[slot.index]] = {
            k: FlatShard(v, slot.start, shape) if k in elementwise else v for k, v in entry.items()
        }
    masters = {
        names[s.index]: FlatShard(s.master if s.valid else s.master.new_empty(0), s.start, s.param.shape)
        for s in layout.slots
        if s.separate_master
    }
    return {
        "state": state,
        "param_groups": _group_entries(layout, param_groups, names),
        "zero": {**extras, "master_weights": masters},
    }


# -- loading ---------------------------------------------------------------------------------------------
def load_state_dict(
    layout: ShardLayout,
    inner: torch.optim.Optimizer,
    param_groups: ParamGroups,
    state_dict: Mapping[str, Any],
    *,
    sharded: bool,
) -> Mapping[str, Any]:
    """Load a full state dict (``sharded=False``: this optimizer's at any world size, or a plain ``torch.optim``
    one) or the form of :func:`named_state_dict` (or the index-keyed form of earlier versions) once
    ``torch.distributed.checkpoint.load`` filled it into ``inner``, ``param_groups`` and the master pieces;
    returns its ``"zero"`` section (empty for a plain one or another plugin's). A parameter without saved state
    comes back unstepped; a separate master without a saved one takes its working value. Reductions must not be
    in flight."""
    what = "load_sharded_state_dict" if sharded else "load_state_dict"
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        other = "load_state_dict" if sharded else "load_sharded_state_dict"
        raise HyperParameterError(
            f"LowLevelZeroOptimizer.{what}: expected a dict with 'state' and 'param_groups' (the output of "
            f"{what.removeprefix('load_')}(), for DCP filled by torch.distributed.checkpoint.load); for the other "
            f"form use {other}."
        )
    groups = list(state_dict["param_groups"])
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(layout.group_slots(g)) for g in range(len(param_groups))]:
        raise HyperParameterError(
            f"LowLevelZeroOptimizer.{what}: the state's param groups hold {sizes} parameters, this optimizer's "
            f"{[len(g['params']) for g in param_groups]}; build the optimizer with the same param groups (the "
            "model must match the checkpoint)."
        )
    names = [str(name) for group in groups for name in group["params"]]

    def lookup(
        mapping: Mapping[Any, Any], slot: Slot
    ) -> Any:  # full: integer keys, or strings after a round trip
        if sharded:
            return mapping.get(names[slot.index])
        return mapping.get(slot.index, mapping.get(str(slot.index)))

    def piece_of(slot: Slot, key: str | None, value: Any) -> Any:  # key None: the master
        if sharded:
            return value.local if isinstance(value, FlatShard) else value
        if key is None or (torch.is_tensor(value) and key != "step" and value.shape == slot.param.shape):
            flat = value.detach().reshape(-1)[slot.start : slot.start + slot.valid]
            return flat if key is None else flat.to(slot.master.device).clone()
        return value

    # a state dict for the inner optimizer over the master pieces, so that its own load casts and checks it
    inner_groups, inner_state, position = [], {}, 0
    for g, saved in enumerate(groups):
        ids = []
        for slot in layout.group_slots(g):
            if not slot.valid:
                continue
            entry = lookup(state_dict["state"], slot)
            if entry is not None:
                inner_state[position] = {key: piece_of(slot, key, value) for key, value in entry.items()}
            ids.append(position)
            position += 1
        inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    copy_hyperparameters(groups, param_groups)
    zero: Mapping[str, Any] = state_dict.get("zero") or {}
    masters = zero.get("master_weights") or {}
    with torch.no_grad():
        for slot in layout.slots:
            if slot.valid and slot.separate_master:
                master = lookup(masters, slot)
                if master is None:
                    slot.master.copy_(slot.param.detach().reshape(-1)[slot.start : slot.start + slot.valid])
                else:
                    slot.master.copy_(piece_of(slot, None, master))
    invalidate_cache(inner)
    return zero
