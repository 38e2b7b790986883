# SPDX-License-Identifier: Apache-2.0
"""A plain ``torch.optim.Optimizer``'s state (one ``Booster.boost`` did not wrap), in ColossalAI's
``GeneralCheckpointIO`` layouts:

- ``shard=False``: ``torch.save(optimizer.state_dict())`` to the file the user names;
- ``shard=True``: directory ``checkpoint`` with ``[prefix-]pytorch_optim_group.bin`` (the ``param_groups``),
  shards ``[prefix-]pytorch_optim-00001.bin``... of at most ``size_per_shard`` MiB (each a ``torch.save`` of
  ``{param index: state}``) and the index ``[prefix-]pytorch_optim.bin.index.json`` (``weight_map``: param index ->
  shard, ``metadata.param_groups``: the group file), written last.

Writes go through the one writer (``commit_file`` / ``commit_files``: atomic, checksummed; a directory keeps the
user's other files). Loads check the manifest first and read with ``torch.load(weights_only=True)``; a directory
holding the single ``pytorch_optim.bin`` of earlier stepforge versions still loads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ._layout import MARKER, CheckpointError, read_torch_file, verify_dir
from ._pending import PendingWrites, staged, write_on_rank0
from ._writer import check_target, on_rank0, write_file, write_files

__all__ = ["load_plain_optimizer", "save_plain_optimizer"]

_STEM = "pytorch_optim"
_INDEX_SUFFIX = ".bin.index.json"


def _stem(prefix: str | None) -> str:
    if not prefix:
        return _STEM
    return f"{prefix}-{_STEM}" if not prefix.endswith(("-", "_")) else f"{prefix}{_STEM}"


def _split(states: dict[Any, dict[str, Any]], cap_bytes: int) -> list[dict[Any, dict[str, Any]]]:
    """``{param index: state}`` in shards of at most ``cap_bytes`` (a parameter's state is never split)."""
    shards: list[dict[Any, dict[str, Any]]] = [{}]
    size = 0
    for index, state in states.items():
        nbytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        if shards[-1] and size + nbytes > cap_bytes:
            shards.append({})
            size = 0
        shards[-1][index] = state
        size += nbytes
    return shards


def _write_sharded(
    state: dict[str, Any], folder: str, prefix: str | None, size_per_shard: float
) -> list[str]:
    stem = _stem(prefix)
    group_file = f"{stem}_group.bin"
    torch.save(state["param_groups"], os.path.join(folder, group_file))
    shards = _split(state["state"], int(size_per_shard * 1024 * 1024))
    names, weight_map, total = [], {}, 0
    for i, part in enumerate(shards, 1):
        name = f"{stem}-{i:05d}.bin"
        torch.save(part, os.path.join(folder, name))
        names.append(name)
        for index, entry in part.items():
            weight_map[str(index)] = name
            total += sum(v.numel() * v.element_size() for v in entry.values() if isinstance(v, torch.Tensor))
    index_name = f"{stem}{_INDEX_SUFFIX}"
    index = {"metadata": {"total_size": total, "param_groups": group_file}, "weight_map": weight_map}
    with open(os.path.join(folder, index_name), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True))
    return [*names, group_file, index_name]


def _stale(prefix: str | None) -> Callable[[str], bool]:
    stem = re.escape(_stem(prefix))
    pattern = re.compile(rf"{stem}(-\d{{5}}\.bin|_group\.bin|\.bin|{re.escape(_INDEX_SUFFIX)})")
    return lambda name: pattern.fullmatch(name) is not None


_META = {"kind": "optimizer", "format": "torch"}


def _check(optimizer: Any, where: str) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )


def write_plain_optimizer(
    state: dict[str, Any], checkpoint: Any, *, shard: bool, prefix: str | None, size_per_shard: float
) -> str:
    """Write ``state`` (an optimizer's ``state_dict()``) in this process alone (rank 0, or its background writer)."""
    if not shard:
        return write_file(
            checkpoint, partial(torch.save, state), arg="checkpoint", where="save_optimizer", meta=_META
        )
    return write_files(
        checkpoint, lambda tmp: _write_sharded(state, tmp, prefix, size_per_shard),
        arg="checkpoint", where="save_optimizer", meta=_META, stale=_stale(prefix),
    )  # fmt: skip


def save_plain_optimizer(
    optimizer: Any,
    checkpoint: Any,
    *,
    shard: bool,
    prefix: str | None,
    size_per_shard: float,
    pending: PendingWrites | None = None,
) -> None:
    """Save ``optimizer.state_dict()`` (collective: rank 0 writes, every rank gets the outcome). ``pending``: the
    state is staged and the target checked now, the write runs on the background writer."""
    _check(optimizer, "save_optimizer")
    if not isinstance(size_per_shard, int | float) or size_per_shard <= 0:
        raise ValueError(f"save_optimizer: size_per_shard must be > 0 (MiB), got {size_per_shard!r}.")
    state = optimizer.state_dict()
    if pending is not None:
        kind = "files" if shard else "file"
        on_rank0(
            partial(check_target, checkpoint, arg="checkpoint", where="save_optimizer", kind=kind),
            where="save_optimizer",
        )
        state = staged(state)
    write = partial(
        write_plain_optimizer, state, checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard
    )
    write_on_rank0(write, where="save_optimizer", pending=pending)


def _read_sharded(index_path: Path) -> dict[str, Any]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        group_file = index["metadata"]["param_groups"]
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"load_optimizer: {index_path} is not an optimizer index ({exc})") from exc
    groups = read_torch_file(index_path.parent / group_file, where="load_optimizer")
    states: dict[int, Any] = {}
    for name in sorted(set(weight_map.values())):
        part = read_torch_file(index_path.parent / name, where="load_optimizer")
        if not isinstance(part, dict):
            raise CheckpointError(
                f"load_optimizer: {index_path.parent / name} holds no optimizer state shard"
            )
        states.update({int(k): v for k, v in part.items()})
    return {"state": states, "param_groups": groups}


def load_plain_optimizer(optimizer: Any, checkpoint: Any, prefix: str | None) -> None:
    """Load a save of :func:`save_plain_optimizer` (a file, a sharded directory or its index JSON) into
    ``optimizer`` with ``load_state_dict`` (every saved state entry restored)."""
    _check(optimizer, "load_optimizer")
    path = Path(checkpoint)
    if path.is_dir():
        if (path / ".metadata").is_file():
            raise ValueError(
                f"load_optimizer: {path} is a torch.distributed.checkpoint save of a boosted optimizer; load "
                "it into the optimizer Booster.boost returned."
            )
        verify_dir(str(path), required=False, where="load_optimizer")
        index = path / f"{_stem(prefix)}{_INDEX_SUFFIX}"
        legacy = path / f"{_stem(prefix)}.bin"
        if index.is_file():
            state = _read_sharded(index)
        elif legacy.is_file():
            state = read_torch_file(legacy, where="load_optimizer")
        else:
            raise FileNotFoundError(
                f"load_optimizer: {path} holds neither {index.name} nor {legacy.name}; pass the directory (and "
                "prefix) given to save_optimizer(shard=True)."
            )
    elif path.name.endswith(_INDEX_SUFFIX):
        if (path.parent / MARKER).is_file():
            verify_dir(str(path.parent), required=True, where="load_optimizer")
        state = _read_sharded(path)
    else:
        state = read_torch_file(path, where="load_optimizer")  # checked against its sidecar manifest first
    optimizer.load_state_dict(state)
