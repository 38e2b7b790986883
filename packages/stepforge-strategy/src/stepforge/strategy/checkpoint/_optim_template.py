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
keys), other parameter groups or parameters, other shapes or dtypes, a plugin's layout where the torch one is
expected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from stepforge.core import unwrap_optimizer

from .._env import is_distributed
from ._dcp import read_dcp_metadata, safe_dcp_load
from ._layout import CheckpointMismatchError

__all__ = ["complete_template", "fit_template", "saved_optimizer_state"]

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


def _is_torch_layout(template: Mapping[str, Any]) -> bool:
    groups = template.get("param_groups")
    return (
        isinstance(template.get("state"), Mapping)
        and isinstance(groups, list)
        and all(
            isinstance(g, Mapping) and all(isinstance(p, str) for p in g.get("params", ())) for g in groups
        )
    )


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
    safe_dcp_load(holder, checkpoint, no_dist=not is_distributed())
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
    saved_state: dict[Any, dict[Any, Any]] = {}
    for p, item in saved.items():
        if len(p) >= 3 and p[0] == "state":
            saved_state.setdefault(p[1], {})[p[2:]] = item
    live_state = template.get("state")
    if isinstance(live_state, dict):
        for key in [k for k in live_state if k not in saved_state]:
            del live_state[key]  # saved before this parameter's first step: it comes back unstepped
    if not _is_torch_layout(template):
        _check_plugin_layout(template, saved, path)
        return
    groups = template["param_groups"]
    saved_groups = _saved_groups(path, saved, root)
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
    params = {
        fqn: param
        for group, torch_group in zip(groups, optimizer.param_groups, strict=True)
        for fqn, param in zip(group["params"], torch_group["params"], strict=True)
    }
    for fqn, entries in saved_state.items():
        if fqn not in params:
            raise _fail(path, f"it holds state for {fqn!r}, which no group of this optimizer names")
        keys = {p[0] for p in entries}
        live = template["state"].get(fqn)
        if live is not None and set(live) != keys:
            raise _fail(path, f"{fqn!r} has state {sorted(keys)} there and {sorted(live)} here")
        if live is None:
            template["state"][fqn] = {
                p[0]: _placeholder(params[fqn], item) for p, item in entries.items() if len(p) == 1
            }
            if any(len(p) != 1 for p in entries):
                raise _fail(path, f"{fqn!r} holds nested state this optimizer has no place for")


def _check_plugin_layout(template: Mapping[str, Any], saved: dict[_Path, Any], path: str) -> None:
    """A plugin's own layout (ZeRO's): every entry of the template is saved, and nothing else is."""
    from stepforge.core.torch_compat import flatten_state_dict

    flat, mapping = flatten_state_dict(dict(template))
    live = {tuple(mapping[k]) for k in flat}
    stored = set(saved)
    if live != stored:
        extra = sorted(".".join(map(str, p)) for p in stored - live)
        absent = sorted(".".join(map(str, p)) for p in live - stored)
        raise _fail(
            path, f"entries only there: {extra[:5]}, only here: {absent[:5]} (another plugin or model?)"
        )


def saved_optimizer_state(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """What a save writes for ``optimizer``: ``state_dict`` as the plugin built it, except that a never-stepped
    optimizer (its torch optimizer holds no state) saves no state entries, whatever placeholders a plugin's
    template carries (ZeRO's): a resume then starts from an unstepped optimizer, as the uninterrupted run."""
    if unwrap_optimizer(optimizer).state or not isinstance(state_dict.get("state"), dict):
        return state_dict
    return {**state_dict, "state": {}}


def complete_template(
    template: dict[str, Any],
    checkpoint: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    *,
    root: str | tuple[str, ...] = "optimizer",
    prune: bool = False,
) -> None:
    """:func:`fit_template` for an optimizer saved under the top-level key ``root`` (the Booster's layout);
    errors start with ``load_optimizer:``."""
    try:
        fit_template(template, checkpoint, optimizer, root=(root,))
    except CheckpointMismatchError as exc:
        raise CheckpointMismatchError(f"load_optimizer: {exc}") from exc
