# SPDX-License-Identifier: Apache-2.0
"""The sharded state dict: every rank's pieces as 1-D ``DTensor`` with ``Shard(0)``, for DCP.

A rank's piece of a parameter (``torch.chunk`` layout of the flattened parameter) is exactly the local shard
of a 1-D ``DTensor`` of the parameter's ``numel`` placed ``Shard(0)`` over a 1-D mesh of the data-parallel
group, so ``torch.distributed.checkpoint`` saves it from every rank without gathering and, at load, reads for
each rank of a *different* world size the piece that rank now owns::

    sd = {"optim": opt.sharded_state_dict()}
    dcp.save(sd, checkpoint_id=path)                 # at 4 ranks
    ...
    sd = {"optim": opt.sharded_state_dict()}         # at 2 ranks: a template of the right pieces
    dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_state_dict(sd["optim"])

Layout: ``{"state": {"<index>": {key: DTensor | scalar}}, "param_groups": [...], "zero": {"loss_scaler": ...,
"skipped_steps": n, "master_weights": {"<index>": DTensor}}}`` (string keys: DCP flattens them into paths).

Like :mod:`.full`, the functions take the :class:`~.partition.ShardLayout`, the inner optimizer and the
working param groups, not the ``LowLevelZeroOptimizer``.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from stepforge.core import HyperParameterError

from .full import ParamGroups, apply_groups, group_entries, inner_state_dict, is_elementwise
from .inner import invalidate_cache
from .partition import ShardLayout

__all__ = ["sharded_state_dict", "load_sharded_state_dict", "materialize_state"]


def _mesh(layout: ShardLayout, device_type: str) -> DeviceMesh:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "LowLevelZeroOptimizer.sharded_state_dict: needs an initialised torch.distributed process group "
            "(DCP and DTensor do); use state_dict() for a single process without one."
        )
    group = layout.group if layout.group is not None else dist.group.WORLD
    assert group is not None, "checked above: a process group is initialised"
    return DeviceMesh.from_group(group, device_type)


@torch.no_grad()
def materialize_state(
    layout: ShardLayout, inner: torch.optim.Optimizer
) -> dict[torch.Tensor, dict[str, Any]]:
    """The state entries of ``inner`` keyed by its masters; for a never-stepped optimizer the entries it will
    hold, built without stepping it: a shallow copy of it with its own groups and state steps zero copies of the
    masters once (lr 0, zero gradients) and the copy's entries are returned. ``inner``, its masters and their
    gradients are never touched."""
    del layout  # the masters are the inner optimizer's parameters
    if inner.state:
        return dict(inner.state)
    proxies: dict[torch.Tensor, torch.Tensor] = {}
    groups = []
    for group in inner.param_groups:
        params = []
        for master in group["params"]:
            proxy = torch.zeros_like(master, requires_grad=True)
            proxy.grad = torch.zeros_like(master)
            proxies[master] = proxy
            params.append(proxy)
        options = {k: v for k, v in group.items() if k != "params"}
        options["lr"] = group["lr"] * 0.0 if torch.is_tensor(group["lr"]) else 0.0
        groups.append({**options, "params": params})
    # a shallow copy with its own groups and state: the class's step (never an instance-patched ``step``, as an
    # lr scheduler installs) runs on the zero copies only
    throwaway = copy.copy(inner)
    throwaway.param_groups = groups
    throwaway.state = collections.defaultdict(dict)
    try:
        type(inner).step(throwaway)
    finally:
        invalidate_cache(inner)  # a cache the copy shares may have seen the copies' tensors
    return {
        master: dict(throwaway.state[proxy]) for master, proxy in proxies.items() if proxy in throwaway.state
    }


def _dtensor(local: torch.Tensor, numel: int, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
    )


def sharded_state_dict(
    layout: ShardLayout,
    inner: torch.optim.Optimizer,
    param_groups: ParamGroups,
    extras: Mapping[str, Any],
) -> dict[str, Any]:
    """See the module docstring. No collectives on the data (DTensor construction only). ``extras``: the
    entries of ``"zero"`` beside the masters (``loss_scaler``, ``skipped_steps``). Reductions must not be in
    flight."""
    entries = materialize_state(layout, inner)  # a never-stepped optimizer is laid out, never stepped
    mesh = _mesh(layout, layout.master_device.type)
    templates: dict[int, dict[str, Any]] = {}  # per group: a local entry to mirror for empty pieces
    for slot in layout.slots:
        entry = entries.get(slot.master) if slot.valid else None
        if entry:
            templates.setdefault(slot.group, dict(entry))
    state: dict[str, dict[str, Any]] = {}
    masters: dict[str, DTensor] = {}
    for slot in layout.slots:
        entry = entries.get(slot.master) if slot.valid else None
        if entry is None and not slot.valid and slot.group in templates:
            # this rank owns nothing of a tiny parameter: an empty piece under the same keys
            entry = {
                k: (
                    torch.empty(0, dtype=v.dtype, device=v.device)
                    if torch.is_tensor(v) and v.dim() == 1
                    else v
                )
                for k, v in templates[slot.group].items()
            }
            elementwise = {k for k, v in entry.items() if torch.is_tensor(v) and v.dim() == 1 and k != "step"}
        elif entry is not None:
            elementwise = {k for k, v in entry.items() if is_elementwise(k, v, slot)}
        else:
            continue
        out: dict[str, Any] = {}
        for key, value in entry.items():
            out[key] = _dtensor(value, slot.numel, mesh) if key in elementwise else value
        state[str(slot.index)] = out
    for slot in layout.slots:
        if slot.separate_master:
            local = slot.master if slot.valid else slot.master.new_empty(0)
            masters[str(slot.index)] = _dtensor(local, slot.numel, mesh)
    out = {
        "state": state,
        "param_groups": group_entries(layout, param_groups),
        "zero": {**extras, "master_weights": masters},
    }
    return out


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def load_sharded_state_dict(
    layout: ShardLayout,
    inner: torch.optim.Optimizer,
    param_groups: ParamGroups,
    state_dict: Mapping[str, Any],
) -> Mapping[str, Any]:
    """Load the form of :func:`sharded_state_dict` once ``torch.distributed.checkpoint.load`` filled it;
    returns its ``"zero"`` section for the caller (loss scaler, skip counter). Reductions must not be in
    flight."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "zero" not in state_dict:
        raise HyperParameterError(
            "LowLevelZeroOptimizer.load_sharded_state_dict: expected the dict returned by sharded_state_dict() "
            "and filled by torch.distributed.checkpoint.load; for a full state dict use load_state_dict."
        )
    groups = list(state_dict["param_groups"])
    if len(groups) != len(param_groups):
        raise HyperParameterError(
            f"LowLevelZeroOptimizer.load_sharded_state_dict: {len(groups)} param groups in the state, "
            f"{len(param_groups)} here; build the optimizer with the same param groups."
        )
    pieces: dict[int, dict[str, Any]] = {}
    for slot in layout.slots:
        entry = state_dict["state"].get(str(slot.index))
        if entry is None or not slot.valid:
            continue
        pieces[slot.index] = {key: _local(value) for key, value in entry.items()}
    inner.load_state_dict(inner_state_dict(layout, groups, pieces))
    apply_groups(param_groups, groups)
    zero: Mapping[str, Any] = state_dict["zero"]
    with torch.no_grad():
        for slot in layout.slots:
            full = zero.get("master_weights", {}).get(str(slot.index))
            if full is not None and slot.valid and slot.separate_master:
                slot.master.copy_(_local(full))
    invalidate_cache(inner)
    return zero
