# SPDX-License-Identifier: Apache-2.0
"""The full (gathered, world-size-independent) state dict of a ``LowLevelZeroOptimizer``.

Layout: ``torch.optim``'s -- ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``
keyed by the global parameter index, every per-element state tensor in the parameter's full shape -- plus
``"zero"``: ``{"loss_scaler": ..., "skipped_steps": n, "master_weights": {index: fp32 tensor}}`` (masters only
for parameters whose master is not the working parameter itself). ``torch.optim.Optimizer.load_state_dict``
ignores the extra key, so the result also loads into the plain inner optimizer over the working parameters.

Gathering is collective: one ``all_gather_object`` for the state's structure, then one
``all_gather_into_tensor`` per (partition, state key).

The functions take the :class:`~.partition.ShardLayout`, the inner optimizer (which steps the master pieces)
and the working param groups -- never the ``LowLevelZeroOptimizer`` itself -- so this module does not import the
optimizer's module. The caller waits for reductions in flight first and owns the ``"zero"`` extras beside the
masters (loss scaler, skip counter): it passes them in to save and applies what the load returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError

from ..comm.collectives import all_gather
from .inner import invalidate_cache
from .partition import Partition, ShardLayout, Slot

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "is_elementwise",
    "inner_state_dict",
    "group_entries",
    "apply_groups",
    "gather_pieces",
    "zero_scaler_entry",
]

ParamGroups = list[dict[str, Any]]

# the loss scaler's two counters as zero's checkpoints have always named them (stepforge.core.precision's scaler
# names them like GradScaler, with an underscore); keeping them keeps old DCP checkpoints, whose template keys
# must match, loadable -- and the core scaler reads both spellings
_ZERO_SCALER_KEYS = {"_growth_tracker": "growth_tracker", "_hysteresis_left": "hysteresis_left"}


def zero_scaler_entry(scaler_state: Mapping[str, Any]) -> dict[str, Any]:
    """``DynamicLossScaler.state_dict()`` in the key layout of ``["zero"]["loss_scaler"]``."""
    return {_ZERO_SCALER_KEYS.get(key, key): value for key, value in scaler_state.items()}


MASTER_KEY = "__master__"


def is_elementwise(key: str, value: Any, slot: Slot) -> bool:
    """Whether a state entry holds one value per element of the parameter (sharded like it)."""
    return (
        isinstance(value, torch.Tensor)
        and key != "step"
        and value.dim() == 1
        and value.numel() == slot.valid
        and slot.valid > 0
    )


def _structure(layout: ShardLayout, inner: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Per parameter index: ``{key: ("elem", dtype) | ("scalar", value)}`` for its state on this rank."""
    out: dict[int, dict[str, Any]] = {}
    for slot in layout.slots:
        state = inner.state.get(slot.master) if slot.valid else None
        if not state:
            continue
        entry: dict[str, Any] = {}
        for key, value in state.items():
            if is_elementwise(key, value, slot):
                entry[key] = ("elem", value.dtype)
            else:
                entry[key] = ("scalar", value.detach().cpu().clone() if torch.is_tensor(value) else value)
        out[slot.index] = entry
    return out


def _merged_structure(layout: ShardLayout, inner: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    local = _structure(layout, inner)
    if layout.world_size == 1:
        return local
    everyone: list[Any] = [None] * layout.world_size
    dist.all_gather_object(everyone, local, group=layout.group)
    merged: dict[int, dict[str, Any]] = {}
    for part in everyone:
        for index, entry in part.items():
            merged.setdefault(index, {})
            for key, spec in entry.items():
                merged[index].setdefault(key, spec)
    return merged


def gather_pieces(
    layout: ShardLayout,
    part: Partition,
    pieces: Mapping[int, torch.Tensor],
    dtype: torch.dtype,
) -> dict[int, torch.Tensor]:
    """All-gather this rank's ``pieces`` (by slot index, ``valid`` elements each) of one partition into full
    tensors on the CPU, shaped like the parameters (slots missing from ``pieces`` on every rank give zeros)."""
    local = torch.zeros(part.size, dtype=dtype, device=part.device)
    for slot in part.slots:
        piece = pieces.get(slot.index)
        if piece is not None and slot.valid:
            local[slot.offset : slot.offset + slot.valid].copy_(piece)
    if layout.world_size > 1:
        gathered = torch.empty(layout.world_size * part.size, dtype=dtype, device=part.device)
        all_gather(gathered, local, group=layout.group)
    else:
        gathered = local
    table = gathered.view(layout.world_size, part.size)
    return {
        slot.index: table[:, slot.offset : slot.offset + slot.piece]
        .reshape(-1)[: slot.numel]
        .reshape(slot.param.shape)
        .cpu()
        .clone()
        for slot in part.slots
    }


def group_entries(
    layout: ShardLayout, param_groups: ParamGroups, names: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """The working ``param_groups`` with each parameter's name (``names[index]``) or, without ``names``, its
    global index instead of tensors."""
    groups = []
    for g, group in enumerate(param_groups):
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = [s.index if names is None else names[s.index] for s in layout.group_slots(g)]
        groups.append(entry)
    return groups


def full_state_dict(
    layout: ShardLayout,
    inner: torch.optim.Optimizer,
    param_groups: ParamGroups,
    extras: Mapping[str, Any],
) -> dict[str, Any]:
    """See the module docstring. Collective over ``layout.group``.

    Args:
        layout: the sharding of the working parameters.
        inner: the optimizer over the master pieces (its ``state`` is keyed by ``slot.master``).
        param_groups: the working param groups (their hyper-parameters are saved).
        extras: entries of ``"zero"`` beside the masters (``loss_scaler``, ``skipped_steps``).
    """
    structure = _merged_structure(layout, inner)
    state: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    for part in layout.partitions:
        keys: dict[str, torch.dtype] = {}
        for slot in part.slots:
            for key, spec in structure.get(slot.index, {}).items():
                if spec[0] == "elem":
                    keys.setdefault(key, spec[1])
        for key in sorted(keys):
            pieces = {}
            for slot in part.slots:
                entry = inner.state.get(slot.master) if slot.valid else None
                if entry is not None and key in entry:
                    pieces[slot.index] = entry[key]
            full = gather_pieces(layout, part, pieces, keys[key])
            for slot in part.slots:
                if key in structure.get(slot.index, {}):
                    state.setdefault(slot.index, {})[key] = full[slot.index]
        if any(s.separate_master for s in part.slots):
            pieces = {s.index: s.master for s in part.slots if s.valid}
            dtype = part.slots[0].master.dtype
            masters.update(gather_pieces(layout, part, pieces, dtype))
    for index, entry in structure.items():
        for key, spec in entry.items():
            if spec[0] == "scalar":
                state.setdefault(index, {})[key] = spec[1]
    # per parameter, the inner optimizer's own key order (torch's Adam: step, exp_avg, exp_avg_sq), as
    # torch.optim and ColossalAI list them -- not element-wise keys first
    ordered = {i: {key: state[i][key] for key in structure[i]} for i in sorted(state)}
    return {
        "state": ordered,
        "param_groups": group_entries(layout, param_groups),
        "zero": {**extras, "master_weights": masters},
    }


def _check_groups(groups: Any, param_groups: ParamGroups) -> None:
    if not isinstance(groups, list | tuple) or len(groups) != len(param_groups):
        count = len(groups) if isinstance(groups, list | tuple) else "no"
        raise HyperParameterError(
            f"LowLevelZeroOptimizer.load_state_dict: the state has {count} param groups, this optimizer "
            f"{len(param_groups)}; build the optimizer with the same param groups as the saved one."
        )
    for g, (saved, ours) in enumerate(zip(groups, param_groups, strict=True)):
        if len(saved["params"]) != len(ours["params"]):
            raise HyperParameterError(
                f"LowLevelZeroOptimizer.load_state_dict: param group {g} holds {len(saved['params'])} "
                f"parameters in the state and {len(ours['params'])} here; the model must match the checkpoint."
            )


def inner_state_dict(
    layout: ShardLayout, groups: list[Mapping[str, Any]], pieces: Mapping[int, Mapping[str, Any]]
) -> dict[str, Any]:
    """A state dict for the inner optimizer over the master pieces (``pieces``: this rank's state by global
    index), so that the inner optimizer's own ``load_state_dict`` casts and checks it."""
    inner_groups = []
    inner_state: dict[int, Any] = {}
    position = 0
    for g, saved in enumerate(groups):
        ids = []
        for slot in layout.group_slots(g):
            if not slot.valid:
                continue
            if slot.index in pieces:
                inner_state[position] = dict(pieces[slot.index])
            ids.append(position)
            position += 1
        inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": inner_state, "param_groups": inner_groups}


def apply_groups(param_groups: ParamGroups, groups: list[Mapping[str, Any]]) -> None:
    """Copy the saved hyper-parameters into the working param groups."""
    for saved, ours in zip(groups, param_groups, strict=True):
        for key, value in saved.items():
            if key != "params":
                ours[key] = value


def load_full_state_dict(
    layout: ShardLayout,
    inner: torch.optim.Optimizer,
    param_groups: ParamGroups,
    state_dict: Mapping[str, Any],
) -> Mapping[str, Any]:
    """Load a full state dict (this optimizer's at any world size, or a plain ``torch.optim`` one) into
    ``inner``, ``param_groups`` and the master pieces; returns its ``"zero"`` section (empty for a plain one)
    for the caller to restore the rest (loss scaler, skip counter). Reductions must not be in flight."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise HyperParameterError(
            "LowLevelZeroOptimizer.load_state_dict: expected a dict with 'state' and 'param_groups' (the output "
            "of state_dict()); for the sharded form use load_sharded_state_dict."
        )
    groups = list(state_dict["param_groups"])
    _check_groups(groups, param_groups)
    saved_state = state_dict["state"]
    pieces: dict[int, dict[str, Any]] = {}
    for slot in layout.slots:
        entry = saved_state.get(slot.index, saved_state.get(str(slot.index)))
        if entry is None or not slot.valid:
            continue
        piece: dict[str, Any] = {}
        for key, value in entry.items():
            if torch.is_tensor(value) and key != "step" and value.shape == slot.param.shape:
                flat = value.detach().reshape(-1)[slot.start : slot.start + slot.valid]
                piece[key] = flat.to(slot.master.device).clone()
            else:
                piece[key] = value
        pieces[slot.index] = piece
    inner.load_state_dict(inner_state_dict(layout, groups, pieces))
    apply_groups(param_groups, groups)
    zero = state_dict.get("zero") or {}
    masters = zero.get("master_weights") or {}
    with torch.no_grad():
        for slot in layout.slots:
            if not slot.valid or not slot.separate_master:
                continue
            full = masters.get(slot.index, masters.get(str(slot.index)))
            if full is None:
                full = slot.param.detach()
            slot.master.copy_(full.reshape(-1)[slot.start : slot.start + slot.valid])
    invalidate_cache(inner)
    return zero
