# SPDX-License-Identifier: Apache-2.0
"""The sharded state dict in the layout every plugin shares: keyed by parameter name, each tensor in its
parameter's shape, this rank's piece only, for ``torch.distributed.checkpoint``.

A rank's piece of a parameter (``torch.chunk`` layout of the flattened parameter) is a
:class:`stepforge.core.flat_shard.FlatShard`: DCP writes it in the parameter's shape as the few boxes the flat
range covers, with no gathering and no communication, and at load reads into it the overlap with whatever was
saved -- this optimizer at another world size, or another plugin (FSDP2's ``Shard(0)`` DTensors, DDP's
replicated tensors)::

    sd = {"optim": opt.sharded_state_dict(names)}
    dcp.save(sd, checkpoint_id=path)                 # at 4 ranks, or under any plugin
    ...
    sd = {"optim": opt.sharded_state_dict(names)}    # at 2 ranks: a template of the right pieces
    dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_state_dict(sd["optim"])

Layout: torch's ``get_optimizer_state_dict``'s -- ``{"state": {name: {key: FlatShard | scalar}}, "param_groups":
[{..., "params": [name, ...]}]}`` -- plus ``"zero": {"loss_scaler": ..., "skipped_steps": n, "master_weights":
{name: FlatShard}}`` (masters only for parameters whose master is not the working parameter itself, so a move
to a plugin with fp32 parameters keeps their fp32 values).

:func:`load_named_state_dict` also reads the index-keyed layout of earlier versions (state keyed ``"<index>"``,
1-D tensors of the flattened parameter, integer ``params``): the template for it is this one with
:meth:`FlatShard.flat` leaves under index keys (see ``stepforge.strategy``'s template fitting).

Like :mod:`.full`, the functions take the :class:`~.partition.ShardLayout`, the inner optimizer and the
working param groups, not the ``LowLevelZeroOptimizer``.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stepforge.core import HyperParameterError
from stepforge.core.flat_shard import FlatShard

from .full import ParamGroups, apply_groups, group_entries, inner_state_dict, is_elementwise
from .inner import invalidate_cache
from .partition import ShardLayout

__all__ = ["named_state_dict", "load_named_state_dict", "materialize_state"]


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


def materialize_state(
    layout: ShardLayout, inner: torch.optim.Optimizer
) -> dict[torch.Tensor, dict[str, Any]]:
    """The state entries of ``inner`` keyed by its masters; for a never-stepped optimizer the entries it will
    hold, built without stepping it (:func:`_throwaway_step` over its masters)."""
    del layout  # the masters are the inner optimizer's parameters
    if inner.state:
        return dict(inner.state)
    entries = _throwaway_step(inner, [list(g["params"]) for g in inner.param_groups])
    return {m: entries[id(m)] for g in inner.param_groups for m in g["params"] if id(m) in entries}


def _group_templates(
    layout: ShardLayout, inner: torch.optim.Optimizer, entries: Mapping[torch.Tensor, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Per param group, a state entry to mirror for the parameters this rank holds nothing of: one of its own,
    or, for a group of which this rank holds no piece with state, the entry of a one-element throwaway step
    (every rank then lists the same entries, so a gather of them is the same on every rank)."""
    templates: dict[int, dict[str, Any]] = {}
    for slot in layout.slots:
        entry = entries.get(slot.master) if slot.valid else None
        if entry:
            templates.setdefault(slot.group, dict(entry))
    missing = {s.group for s in layout.slots} - set(templates)
    if missing:
        device, dtype = layout.master_device, layout.slots[0].master.dtype
        probes = [
            [torch.zeros(1, device=device, dtype=dtype)] if g in missing else []
            for g in range(len(inner.param_groups))
        ]
        got = _throwaway_step(inner, probes)
        for g in missing:
            if id(probes[g][0]) in got:
                templates[g] = got[id(probes[g][0])]
    return templates


def named_state_dict(
    layout: ShardLayout,
    inner: torch.optim.Optimizer,
    param_groups: ParamGroups,
    names: Sequence[str],
    extras: Mapping[str, Any],
) -> dict[str, Any]:
    """See the module docstring. ``names``: each parameter's name by global index. No collectives.
    ``extras``: the entries of ``"zero"`` beside the masters (``loss_scaler``, ``skipped_steps``). Reductions
    must not be in flight."""
    if len(names) != len(layout.slots):
        raise HyperParameterError(
            f"LowLevelZeroOptimizer.sharded_state_dict: {len(names)} names for {len(layout.slots)} parameters; "
            "pass one name per parameter, in param-group order."
        )
    entries = materialize_state(layout, inner)  # a never-stepped optimizer is laid out, never stepped
    templates = _group_templates(layout, inner, entries)
    state: dict[str, dict[str, Any]] = {}
    masters: dict[str, FlatShard] = {}
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
            elementwise = {k for k, v in entry.items() if is_elementwise(k, v, slot)}
        else:
            continue
        shape = slot.param.shape
        state[names[slot.index]] = {
            k: FlatShard(v, slot.start, shape) if k in elementwise else v for k, v in entry.items()
        }
    for slot in layout.slots:
        if slot.separate_master:
            local = slot.master if slot.valid else slot.master.new_empty(0)
            masters[names[slot.index]] = FlatShard(local, slot.start, slot.param.shape)
    return {
        "state": state,
        "param_groups": group_entries(layout, param_groups, names),
        "zero": {**extras, "master_weights": masters},
    }


def _local(value: Any) -> Any:
    return value.local if isinstance(value, FlatShard) else value


def load_named_state_dict(
    layout: ShardLayout,
    inner: torch.optim.Optimizer,
    param_groups: ParamGroups,
    state_dict: Mapping[str, Any],
) -> Mapping[str, Any]:
    """Load the form of :func:`named_state_dict` (or the index-keyed form of earlier versions) once
    ``torch.distributed.checkpoint.load`` filled it; returns its ``"zero"`` section for the caller (loss scaler,
    skip counter; empty when another plugin saved it). A parameter without saved state comes back unstepped; a
    low-precision parameter without a saved master takes it from its working value. Reductions must not be in
    flight."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise HyperParameterError(
            "LowLevelZeroOptimizer.load_sharded_state_dict: expected the dict returned by sharded_state_dict() "
            "and filled by torch.distributed.checkpoint.load; for a full state dict use load_state_dict."
        )
    groups = list(state_dict["param_groups"])
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(layout.group_slots(g)) for g in range(len(param_groups))]:
        raise HyperParameterError(
            f"LowLevelZeroOptimizer.load_sharded_state_dict: the state's param groups hold {sizes} parameters, "
            "this optimizer's another number; build the optimizer with the same param groups."
        )
    names = [str(name) for group in groups for name in group["params"]]
    pieces: dict[int, dict[str, Any]] = {}
    for slot in layout.slots:
        entry = state_dict["state"].get(names[slot.index])
        if entry is not None and slot.valid:
            pieces[slot.index] = {key: _local(value) for key, value in entry.items()}
    inner.load_state_dict(inner_state_dict(layout, groups, pieces))
    apply_groups(param_groups, groups)
    zero: Mapping[str, Any] = state_dict.get("zero") or {}
    masters = zero.get("master_weights") or {}
    with torch.no_grad():
        for slot in layout.slots:
            if slot.valid and slot.separate_master:
                saved = masters.get(names[slot.index])
                if saved is None:
                    saved = slot.param.detach().reshape(-1)[slot.start : slot.start + slot.valid]
                slot.master.copy_(_local(saved))
    invalidate_cache(inner)
    return zero
