# SPDX-License-Identifier: Apache-2.0
"""Fit a ``dcp.load`` template for an optimizer to what a checkpoint holds, from shapes, or refuse before reading.

``torch.distributed.checkpoint.load`` fills exactly the entries of the state dict it is given. The plugin's
template is the live optimizer's state dict, and it may differ from the checkpoint's without either being wrong:

- a never-stepped optimizer has no state (the plugins never run torch's zero-lr "initialising" ``step()``): each
  state entry the checkpoint holds gets a placeholder shaped like its parameter (a ``DTensor`` of the same
  placements for a sharded one) or like the saved entry;
- a stepped optimizer resuming a checkpoint saved before the first step: the live entries the checkpoint lacks are
  dropped from the template, and the optimizer comes back unstepped, as it was saved.

Everything else is a :class:`CheckpointMismatchError` naming the difference, raised after reading the metadata
and the (small) parameter groups only, before any tensor is read: another optimizer type (other state or group
keys), other parameter groups or parameters, other shapes or dtypes.

Every plugin saves the same layout (torch's ``get_optimizer_state_dict``: keyed by parameter name, tensors in the
parameter's shape, a plugin's extras beside ``state`` and ``param_groups``), so a checkpoint of one plugin fits
the template of any other: the extras the template lacks get a place that reads nothing (a tensor) or little (an
object), and the template's extras the checkpoint lacks are dropped. A ZeRO checkpoint of the index-keyed layout
of earlier versions is read by viewing ZeRO's pieces flat under index keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from stepforge.core import unwrap_optimizer
from stepforge.core.flat_shard import FlatShard
from stepforge.core.torch_compat import flatten_state_dict

from ._dcp import read_dcp_metadata, safe_dcp_load
from ._layout import CheckpointMismatchError

__all__ = ["fit_template", "fit_template_to_state", "saved_optimizer_state"]

_Path = tuple[Any, ...]


def _saved_paths(metadata: Metadata, root: _Path) -> dict[_Path, Any]:
    """Object path (below ``root``) -> storage metadata of every saved leaf under ``root``."""
    mapping = metadata.planner_data or {}
    out: dict[_Path, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        path = tuple(mapping.get(key, (key,)))
        if path[: len(root)] == root:
            out[path[len(root) :]] = item
    return out


def _saved_groups(checkpoint: str, saved: dict[_Path, Any], root: _Path) -> list[dict[str, Any]]:
    """The saved ``param_groups`` (small, non-tensor values), read on their own into a fresh holder."""
    groups: dict[int, dict[str, Any]] = {}
    for path in saved:
        if len(path) == 3 and path[0] == "param_groups" and isinstance(path[1], int):
            groups.setdefault(path[1], {})[path[2]] = None
    holder: dict[str, Any] = {"param_groups": [groups[i] for i in sorted(groups)]}
    for part in reversed(root):
        holder = {part: holder}
    # the restricted reader and planner: a payload in a saved value raises CheckpointError, it never runs
    safe_dcp_load(holder, checkpoint)
    node: Any = holder
    for part in root:
        node = node[part]
    return list(node["param_groups"])


def _placeholder(param: torch.Tensor, item: Any) -> Any:
    if not isinstance(item, TensorStorageMetadata):
        return None  # a non-tensor value: DCP reads it whole
    size, dtype = tuple(item.size), item.properties.dtype
    if tuple(param.shape) == size:
        return torch.empty_like(param, dtype=dtype)  # a DTensor parameter gets a DTensor of its placements
    device = param.device_mesh.device_type if isinstance(param, DTensor) else param.device
    return torch.empty(size, dtype=dtype, device=device)


def _skipped(item: Any) -> Any:
    """A place for a saved entry this optimizer does not use (another plugin's extras): an object is read (it is
    small), a tensor gets a :class:`FlatShard` of no elements, which DCP reads nothing into."""
    if not isinstance(item, TensorStorageMetadata):
        return None
    return FlatShard(torch.empty(0, dtype=item.properties.dtype), 0, tuple(item.size))


def _drop_empty(node: Any) -> bool:
    """Remove the empty dicts inside ``node``; whether anything is left in it."""
    if not isinstance(node, dict):
        return True
    for key in [k for k, v in node.items() if not _drop_empty(v)]:
        del node[key]
    return bool(node)


def _fit_extras(template: dict[str, Any], saved: dict[_Path, Any]) -> None:
    """Outside ``state`` and ``param_groups`` (a plugin's extras, ZeRO's ``zero``): drop the template's entries
    the checkpoint lacks, give every saved one a place."""
    extras = {k: v for k, v in template.items() if k not in ("state", "param_groups")}
    flat, mapping = flatten_state_dict(extras)
    for key in flat:
        path = tuple(mapping[key])
        if path not in saved:
            node: Any = template
            for part in path[:-1]:
                node = node[part]
            del node[path[-1]]
    for key in extras:
        if not _drop_empty(template[key]):
            del template[key]  # nothing of it is saved: the plugin gets no such section
    for path, item in saved.items():
        if path[0] in ("state", "param_groups"):
            continue
        node = template
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if path[-1] not in node:
            node[path[-1]] = _skipped(item)


def _to_index_keys(template: dict[str, Any], path: str) -> None:
    """Make a named template read the index-keyed layout of ZeRO before the named one (state under
    ``"<index>"``, 1-D tensors of the flattened parameter, integer ``params``): its pieces seen flat, no copy."""
    index = {name: i for i, name in enumerate(n for g in template["param_groups"] for n in g["params"])}

    if not any(isinstance(v, FlatShard) for entry in template["state"].values() for v in entry.values()):
        raise _fail(
            path,
            "it is a ZeRO checkpoint of an earlier version (keyed by parameter index, flattened), which only "
            "ZeRO reads; load it under zero1/zero2 and save it again to move it to another plugin",
        )

    def flat(value: Any) -> Any:
        return value.flat() if isinstance(value, FlatShard) else value

    template["state"] = {
        str(index[n]): {k: flat(v) for k, v in entry.items()} for n, entry in template["state"].items()
    }
    for group in template["param_groups"]:
        group["params"] = [index[n] for n in group["params"]]
    masters = template.get("zero", {}).get("master_weights")
    if isinstance(masters, dict):
        template["zero"]["master_weights"] = {str(index[n]): flat(v) for n, v in masters.items()}


def _fail(checkpoint: str, what: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"checkpoint {checkpoint!r} does not fit this optimizer: {what}; load it into the optimizer class, "
        "parameter groups and plugin that saved it"
    )


def fit_template(
    template: dict[str, Any],
    checkpoint: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    *,
    root: _Path = ("optimizer",),
    metadata: Metadata | None = None,
) -> None:
    """Make ``template`` (the plugin's optimizer state dict, saved under the object path ``root``) hold exactly
    the optimizer entries the checkpoint holds (see the module docstring). Reads metadata and groups only.

    Raises:
        CheckpointMismatchError: the checkpoint was saved for another optimizer type, other groups or other
            parameters; nothing live has been touched.
    """
    path = str(checkpoint)
    saved = _saved_paths(metadata if metadata is not None else read_dcp_metadata(path), root)
    if not saved:
        raise _fail(path, "its optimizer entries are missing (saved with save_optimizer=False?)")
    _fit(template, saved, _saved_groups(path, saved, root), path, optimizer)


def fit_template_to_state(
    template: dict[str, Any], state: Mapping[str, Any], checkpoint: str | os.PathLike[str], optimizer: Any
) -> None:
    """:func:`fit_template` for a full optimizer state already in memory (a one-file save)."""
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list):
        raise _fail(str(checkpoint), "it holds no optimizer state with 'param_groups'")
    flat, mapping = flatten_state_dict(dict(state))
    saved = {
        tuple(mapping[key]): TensorStorageMetadata(TensorProperties(dtype=v.dtype), v.size(), [])
        if isinstance(v, torch.Tensor)
        else BytesStorageMetadata()
        for key, v in flat.items()
    }
    _fit(template, saved, list(state["param_groups"]), str(checkpoint), unwrap_optimizer(optimizer))


def _fit(
    template: dict[str, Any],
    saved: dict[_Path, Any],
    saved_groups: list[dict[str, Any]],
    path: str,
    optimizer: torch.optim.Optimizer,
) -> None:
    groups = template["param_groups"]
    if any(isinstance(p, int) for g in saved_groups for p in g.get("params", ())):
        _to_index_keys(template, path)
    saved_state: dict[Any, dict[Any, Any]] = {}
    for p, item in saved.items():
        if len(p) >= 3 and p[0] == "state":
            saved_state.setdefault(p[1], {})[p[2:]] = item
    live_state = template["state"]
    for key in [k for k in live_state if k not in saved_state]:
        del live_state[key]  # saved before this parameter's first step: it comes back unstepped
    _fit_extras(template, saved)
    if len(saved_groups) != len(groups):
        raise _fail(path, f"{len(saved_groups)} parameter groups there, {len(groups)} here")
    for i, (mine, theirs) in enumerate(zip(groups, saved_groups, strict=True)):
        if set(mine) != set(theirs):
            raise _fail(
                path,
                f"parameter group {i} has options {sorted(set(theirs) - {'params'})} there and "
                f"{sorted(set(mine) - {'params'})} here (another optimizer type)",
            )
        if list(theirs.get("params", ())) != list(mine["params"]):
            extra = sorted(set(theirs.get("params", ())) - set(mine["params"]))
            absent = sorted(set(mine["params"]) - set(theirs.get("params", ())))
            raise _fail(
                path,
                f"parameter group {i} holds {len(theirs.get('params', ()))} parameters there and "
                f"{len(mine['params'])} here (only there: {extra[:4]}, only here: {absent[:4]})",
            )
    # the optimizer's own parameters by name, where its groups are the template's (a ZeRO template names
    # every parameter itself, its inner optimizer steps pieces)
    params = {}
    if [len(g["params"]) for g in groups] == [len(g["params"]) for g in optimizer.param_groups]:
        params = {
            name: param
            for group, torch_group in zip(groups, optimizer.param_groups, strict=True)
            for name, param in zip(group["params"], torch_group["params"], strict=True)
        }
    for fqn, entries in saved_state.items():
        keys = {p[0] for p in entries}
        live = live_state.get(fqn)
        if live is not None and set(live) != keys:
            raise _fail(path, f"{fqn!r} has state {sorted(keys)} there and {sorted(live)} here")
        if live is None:
            if fqn not in params:
                raise _fail(path, f"it holds state for {fqn!r}, which this optimizer has no place for")
            live_state[fqn] = {
                p[0]: _placeholder(params[fqn], item) for p, item in entries.items() if len(p) == 1
            }
            if any(len(p) != 1 for p in entries):
                raise _fail(path, f"{fqn!r} holds nested state this optimizer has no place for")


def saved_optimizer_state(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """What a save writes for ``optimizer``: ``state_dict`` as the plugin built it, except that a never-stepped
    optimizer (its torch optimizer holds no state) saves no state entries, whatever placeholders a plugin's
    template carries (ZeRO's): a resume then starts from an unstepped optimizer, as the uninterrupted run."""
    if unwrap_optimizer(optimizer).state or not isinstance(state_dict.get("state"), dict):
        return state_dict
    return {**state_dict, "state": {}}
