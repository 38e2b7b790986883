# SPDX-License-Identifier: Apache-2.0
"""Make a ``dcp.load`` template cover every entry an optimizer checkpoint holds, or refuse before reading.

``torch.distributed.checkpoint.load`` fills only the entries of the state dict it is given. The template of a
fresh ``SGD(lr=...)`` has no ``momentum_buffer``, so a save of ``SGD(momentum=0.5)`` would load its groups
(``momentum=0.5``) and silently drop every buffer. torch's ``Optimizer.load_state_dict`` creates the entries a
fresh optimizer lacks; :func:`complete_template` does the same for the DCP route: it reads the checkpoint's
metadata (no tensor data), adds a placeholder for each saved entry the template lacks (shaped like its
parameter, a ``DTensor`` when the parameter is one) and raises ``ValueError`` for what it cannot place (another
model's parameters, a plugin's own layout), before any tensor of the optimizer is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from stepforge.core import SafeFileSystemReader

from .checkpoint import CheckpointError, safe_dcp_load

__all__ = ["complete_template"]

_Path = tuple[Any, ...]


def _read_metadata(checkpoint: str | os.PathLike[str]) -> Metadata:
    # the restricted reader: DCP's metadata classes only, so reading it runs no code from the checkpoint
    try:
        metadata: Metadata = SafeFileSystemReader(str(checkpoint)).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r}: its DCP metadata is unreadable or refused ({exc})"
        ) from exc
    return metadata


def _saved_paths(metadata: Metadata, root: _Path) -> dict[_Path, Any]:
    """Object path (below the ``root`` path) -> storage metadata of every saved leaf under ``root``."""
    mapping = metadata.planner_data or {}
    out: dict[_Path, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        path = tuple(mapping.get(key, (key,)))
        if len(path) > len(root) and path[: len(root)] == root:
            out[path[len(root) :]] = item
    return out


def _prune_state(template: dict[str, Any], saved: dict[_Path, Any]) -> None:
    """Drop the template's ``state`` entries the checkpoint does not hold: an optimizer saved before its first
    step holds none, and loading it must leave the optimizer without state (not with the template's)."""
    state = template.get("state")
    if not isinstance(state, dict):
        return
    for key in list(state):
        entry = state[key]
        if isinstance(entry, dict):
            for name in [n for n in entry if ("state", key, n) not in saved]:
                del entry[name]
            if not entry:
                del state[key]
        elif ("state", key) not in saved:
            del state[key]


def _has(template: Any, path: _Path) -> bool:
    node = template
    for part in path:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return False
    return True


def _is_torch_layout(template: Mapping[str, Any]) -> bool:
    groups = template.get("param_groups")
    return (
        isinstance(template.get("state"), Mapping)
        and isinstance(groups, list)
        and all(
            isinstance(g, Mapping) and all(isinstance(p, str) for p in g.get("params", ())) for g in groups
        )
    )


def _saved_groups(
    checkpoint: str | os.PathLike[str], saved: dict[_Path, Any], root: _Path
) -> list[dict[str, Any]]:
    """The saved ``param_groups`` (small, non-tensor values), read on their own."""
    groups: dict[int, dict[str, Any]] = {}
    for path in saved:
        if len(path) == 3 and path[0] == "param_groups" and isinstance(path[1], int):
            groups.setdefault(path[1], {})[path[2]] = None
    inner: dict[str, Any] = {"param_groups": [groups[i] for i in sorted(groups)]}
    holder = inner
    for part in reversed(root):
        holder = {part: holder}
    # the restricted reader and planner: a payload in a saved value raises CheckpointError, it never runs
    distributed = dist.is_available() and dist.is_initialized()
    safe_dcp_load(holder, str(checkpoint), no_dist=not distributed)
    result: list[dict[str, Any]] = inner["param_groups"]
    return result


def _placeholder(param: torch.Tensor, item: Any) -> Any:
    if not isinstance(item, TensorStorageMetadata):
        return None  # a non-tensor value: DCP reads it whole
    size, dtype = tuple(item.size), item.properties.dtype
    if tuple(param.shape) == size:
        return torch.empty_like(param, dtype=dtype)  # a DTensor parameter gets a DTensor of its placements
    device = param.device_mesh.device_type if isinstance(param, DTensor) else param.device
    return torch.empty(size, dtype=dtype, device=device)


def complete_template(
    template: dict[str, Any],
    checkpoint: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    *,
    root: str | tuple[str, ...] = "optimizer",
    prune: bool = False,
) -> None:
    """Add to ``template`` (the plugin's optimizer state dict, saved under ``root``, a key or a path of keys)
    every entry the checkpoint holds and it lacks, so that ``dcp.load`` restores all saved state.

    ``prune=True`` also drops the template's ``state`` entries the checkpoint lacks, so that the loaded optimizer
    holds exactly the saved state (none for an optimizer saved before its first step).

    Raises:
        ValueError: the checkpoint's parameter groups name other parameters than ``optimizer``'s, or it holds
            entries that cannot be placed; nothing has been loaded then.
    """
    root_path = (root,) if isinstance(root, str) else tuple(root)
    saved = _saved_paths(_read_metadata(checkpoint), root_path)
    if not saved:
        return  # no optimizer saved at all: the caller's layout check names what is missing
    if prune:
        _prune_state(template, saved)
    missing = [path for path in saved if not _has(template, path)]
    if not _is_torch_layout(template):
        if not missing:
            return
        shown = ", ".join(".".join(map(str, p)) for p in missing[:8])
        raise ValueError(
            f"load_optimizer: {checkpoint} holds optimizer state this optimizer has no place for ({shown}); "
            "load it into the optimizer class and plugin that saved it."
        )
    groups = template["param_groups"]
    saved_groups = _saved_groups(checkpoint, saved, root_path)
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"load_optimizer: {checkpoint} has {len(saved_groups)} parameter groups, the optimizer "
            f"{len(groups)}; build the optimizer with the groups it was saved with."
        )
    for i, (mine, theirs) in enumerate(zip(groups, saved_groups, strict=True)):
        extra, absent = (
            set(theirs.get("params", ())) - set(mine["params"]),
            set(mine["params"]) - set(theirs.get("params", ())),
        )
        if extra or absent:
            raise ValueError(
                f"load_optimizer: parameter group {i} of {checkpoint} holds parameters {sorted(extra)} that the "
                f"model lacks and lacks {sorted(absent)}; load it into the model it was saved from."
            )
    params = {
        fqn: param
        for group, torch_group in zip(groups, optimizer.param_groups, strict=True)
        for fqn, param in zip(group["params"], torch_group["params"], strict=True)
    }
    for path in missing:
        if path[0] == "param_groups" and len(path) == 3:
            groups[path[1]][path[2]] = None  # a group option the target optimizer does not have
        elif path[0] == "state" and len(path) == 3 and path[1] in params:
            template["state"].setdefault(path[1], {})[path[2]] = _placeholder(params[path[1]], saved[path])
        else:
            raise ValueError(
                f"load_optimizer: {checkpoint} holds {'.'.join(map(str, path))}, which this optimizer has no "
                "place for; load it into the optimizer class that saved it."
            )
