# SPDX-License-Identifier: Apache-2.0
"""The Booster's boosted-optimizer and lr-scheduler saves and loads.

Every plugin's ``get_state_dict`` gives the optimizer state in one layout: keyed by parameter FQN, each tensor
this rank's part of a tensor in its parameter's shape (a plain tensor, an FSDP2 ``DTensor``, a ZeRO
``FlatShard``). ``shard=True`` goes through ``torch.distributed.checkpoint`` (every rank writes its part; ``dcp.load``
fills any plugin's template at any world size); ``shard=False`` is one ``torch.save`` file of the full state
gathered to rank 0 (ColossalAI's unsharded save), from which every rank copies out its part. The fp16
loss-scaler state (``grad_scaler``) rides along. The plugin and the optimizer meet here only through
:class:`stepforge.core.Plugin` and :class:`stepforge.core.BoostedOptimizer`.

A plain ``torch.optim.Optimizer`` (one ``boost`` did not wrap) is saved as its ``state_dict()`` in ColossalAI's
``GeneralCheckpointIO`` layouts: ``shard=False``: one ``torch.save`` file; ``shard=True``: directory
``checkpoint`` with ``[prefix-]pytorch_optim_group.bin`` (the ``param_groups``), shards
``[prefix-]pytorch_optim-00001.bin``... of at most ``size_per_shard`` MiB (each ``{param index: state}``) and the
index ``[prefix-]pytorch_optim.bin.index.json`` (``weight_map``: param index -> shard, ``metadata.param_groups``:
the group file), written last. A directory holding the single ``pytorch_optim.bin`` of earlier versions loads.
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
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor

from stepforge.core import BoostedOptimizer, Plugin, unwrap_optimizer
from stepforge.core.flat_shard import FlatShard

from .._env import get_rank, is_distributed
from ._dcp import dcp_save, fresh_like, safe_dcp_load
from ._layout import CheckpointError, CheckpointMismatchError, read_torch_file, verify_dir, verify_save
from ._model_io import prefixed
from ._optim_template import fit_template, fit_template_to_state, saved_optimizer_state
from ._pending import PendingWrites, async_save_group, staged, write_on_rank0
from ._writer import (
    begin_dir,
    check_target,
    commit_dir,
    commit_file,
    finish_dir,
    write_file,
    write_files,
)

__all__ = [
    "load_lr_scheduler",
    "load_optimizer",
    "load_plain_optimizer",
    "save_lr_scheduler",
    "save_optimizer",
    "save_plain_optimizer",
]


_META = {"kind": "optimizer"}


@torch.no_grad()
def _gathered(value: Any) -> Any:
    """``value`` with every tensor part made the full tensor, on the CPU of rank 0 (``None`` elsewhere).
    Collective: every rank walks the same structure (the plugins' state dicts have the same keys on every rank)."""
    if isinstance(value, dict):
        return {k: _gathered(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_gathered(v) for v in value]
    if isinstance(value, DTensor):
        full = value.full_tensor()
    elif isinstance(value, FlatShard):
        # the ranks' ranges are disjoint and cover the tensor: their sum on rank 0 is the tensor
        full = value.local.new_zeros(value.numel())
        full[value.start : value.start + value.local.numel()] = value.local
        if is_distributed():
            torch.distributed.reduce(full, dst=0)
        full = full.view(value.shape)
    elif isinstance(value, torch.Tensor):
        full = value
    else:
        return value
    return full.detach().to("cpu", copy=True) if get_rank() == 0 else None


@torch.no_grad()
def _fill(template: Any, full: Any) -> Any:
    """Copy this rank's part of each full tensor of ``full`` into the tensors of ``template`` (fresh ones);
    returns the filled structure (objects taken from ``full``)."""
    if isinstance(template, dict):
        return {k: _fill(v, full[k]) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, f) for v, f in zip(template, full, strict=True)]
    if isinstance(template, DTensor | FlatShard):
        for chunk in template.__create_chunk_list__():
            part = template.__get_tensor_shard__(MetadataIndex("", chunk.offsets))
            box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
            part.copy_(full[box])
        return template
    if isinstance(template, torch.Tensor):
        return template.copy_(full)
    return full


def save_optimizer(
    plugin: Plugin,
    model: nn.Module,
    optimizer: BoostedOptimizer,
    checkpoint: str | os.PathLike[str],
    *,
    shard: bool = True,
    pending: PendingWrites | None = None,
) -> None:
    """Write the optimizer state (collective): ``shard=True``: every rank's part to directory ``checkpoint``
    through DCP; ``shard=False``: the full state to the one file ``checkpoint``, written by rank 0.

    ``pending`` (an asynchronous save): the state is staged (copied to CPU; a sharded save's directory begun)
    here; the write and the commit run on the background writer (``_pending.py``), on its own process group."""
    _, optim_sd = plugin.get_state_dict(model, optimizer)
    state: dict[str, Any] = {"optimizer": saved_optimizer_state(optimizer, optim_sd)}
    scaler = optimizer.scaler_state_dict()
    if scaler is not None:
        state["grad_scaler"] = scaler
    if not shard:
        save = partial(torch.save, _gathered(state))
        write = partial(write_file, checkpoint, save, arg="checkpoint", where="save_optimizer", meta=_META)
        write_on_rank0(write, where="save_optimizer", pending=pending)
        return
    if pending is None:
        commit_dir(checkpoint, partial(dcp_save, state), meta=_META, arg="checkpoint", where="save_optimizer")
        return
    copy = staged(state)  # a CPU copy (DTensors and FlatShards keep their kind): what the writer reads
    final, tmp = begin_dir(checkpoint, arg="checkpoint", where="save_optimizer")
    group = async_save_group()
    write_dcp = partial(dcp_save, copy, process_group=group)
    commit = partial(finish_dir, final, tmp, write_dcp, meta=_META, where="save_optimizer", group=group)
    pending.submit(commit, where="save_optimizer")


def load_optimizer(
    plugin: Plugin, model: nn.Module, optimizer: BoostedOptimizer, checkpoint: str | os.PathLike[str]
) -> None:
    """Fill ``optimizer`` from a directory or file written by :func:`save_optimizer` under any plugin at any
    world size (collective).

    Every saved entry is restored, those a fresh optimizer lacks included (as torch's ``load_state_dict``
    does); a checkpoint of other parameters raises ``ValueError`` before anything is loaded.
    """
    path = Path(checkpoint)
    model_sd, optim_sd = plugin.get_state_dict(model, optimizer)
    scaler = optimizer.scaler_state_dict()
    saved: Any = None
    if path.is_file():
        saved = read_torch_file(path, where="load_optimizer")  # no code runs from it (CheckpointError)
        if not isinstance(saved, dict) or "optimizer" not in saved:
            raise CheckpointMismatchError(
                f"load_optimizer: {path} holds no 'optimizer' entry; pass a file written by save_optimizer"
            )
    elif not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"load_optimizer: {path} is neither a file of save_optimizer(shard=False) nor a "
            "torch.distributed.checkpoint directory (no .metadata); pass the path given to save_optimizer."
        )
    else:  # a directory without COMMIT.json (torch's own dcp.save) is read through the restricted reader only
        verify_dir(str(path), required=False, where="load_optimizer")
    # every saved entry gets a place (or CheckpointMismatchError, a ValueError) before any tensor is read
    try:
        if saved is None:
            fit_template(optim_sd, path, unwrap_optimizer(optimizer))
        else:
            fit_template_to_state(optim_sd, saved["optimizer"], path, optimizer)
    except CheckpointMismatchError as exc:
        raise CheckpointMismatchError(f"load_optimizer: {exc}") from exc
    fresh = fresh_like({"optimizer": optim_sd, "grad_scaler": scaler})  # a failed read changes nothing live
    if saved is None:
        if scaler is None:
            del fresh["grad_scaler"]
        safe_dcp_load(fresh, str(path))
    else:
        fresh = {
            "optimizer": _fill(fresh["optimizer"], saved["optimizer"]),
            "grad_scaler": saved.get("grad_scaler"),
        }
    plugin.set_state_dict(model, optimizer, model_sd, fresh["optimizer"])
    if scaler is not None and fresh.get("grad_scaler") is not None:
        optimizer.load_scaler_state_dict(fresh["grad_scaler"])


def save_lr_scheduler(lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
    """``torch.save(lr_scheduler.state_dict())`` to file ``checkpoint`` on rank 0, through the one writer (an
    existing file is replaced atomically); every rank calls and gets the outcome."""
    if not hasattr(lr_scheduler, "state_dict"):
        raise TypeError(f"save_lr_scheduler: {type(lr_scheduler).__name__} has no state_dict().")
    state = lr_scheduler.state_dict()
    commit_file(
        checkpoint, partial(torch.save, state), arg="checkpoint", where="save_lr_scheduler",
        meta={"kind": "lr_scheduler"},
    )  # fmt: skip


def load_lr_scheduler(lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
    """Load a file written by :func:`save_lr_scheduler` (``CheckpointError`` when it holds anything but plain
    values and tensors: no code runs from the file)."""
    state = read_torch_file(checkpoint, where="load_lr_scheduler")
    live = set(lr_scheduler.state_dict())
    if not isinstance(state, dict) or set(state) != live:
        theirs = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointMismatchError(
            f"load_lr_scheduler: {checkpoint} holds {theirs}, {type(lr_scheduler).__name__} has {sorted(live)}: "
            "it was saved from another scheduler type; nothing was loaded"
        )
    lr_scheduler.load_state_dict(state)


_STEM = "pytorch_optim"
_INDEX_SUFFIX = ".bin.index.json"


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
    stem = prefixed(prefix, _STEM)
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
    stem = re.escape(prefixed(prefix, _STEM))
    pattern = re.compile(rf"{stem}(-\d{{5}}\.bin|_group\.bin|\.bin|{re.escape(_INDEX_SUFFIX)})")
    return lambda name: pattern.fullmatch(name) is not None


_PLAIN_META = {"kind": "optimizer", "format": "torch"}


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
            checkpoint, partial(torch.save, state), arg="checkpoint", where="save_optimizer", meta=_PLAIN_META
        )
    return write_files(
        checkpoint, lambda tmp: _write_sharded(state, tmp, prefix, size_per_shard),
        arg="checkpoint", where="save_optimizer", meta=_PLAIN_META, stale=_stale(prefix),
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
    state = optimizer.state_dict() if pending is None else staged(optimizer.state_dict())
    kind = "files" if shard else "file"
    claim = partial(check_target, checkpoint, arg="checkpoint", where="save_optimizer", kind=kind)
    write = partial(
        write_plain_optimizer, state, checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard
    )
    write_on_rank0(write, where="save_optimizer", pending=pending, claim=claim)


def _read_sharded(index_path: Path) -> dict[str, Any]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        group_file = index["metadata"]["param_groups"]
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"load_optimizer: {index_path} is not an optimizer index ({exc})") from exc
    groups = read_torch_file(index_path.parent / group_file, where="load_optimizer", verify=False)
    states: dict[int, Any] = {}
    for name in sorted(set(weight_map.values())):
        part = read_torch_file(index_path.parent / name, where="load_optimizer", verify=False)
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
    if (path / ".metadata").is_file():
        raise ValueError(
            f"load_optimizer: {path} is a torch.distributed.checkpoint save of a boosted optimizer; load "
            "it into the optimizer Booster.boost returned."
        )
    verify_save(str(path), where="load_optimizer")  # COMMIT.json or the sidecar manifest, before any read
    if path.is_dir():
        index = path / f"{prefixed(prefix, _STEM)}{_INDEX_SUFFIX}"
        legacy = path / f"{prefixed(prefix, _STEM)}.bin"
        if not index.is_file() and not legacy.is_file():
            raise FileNotFoundError(
                f"load_optimizer: {path} holds neither {index.name} nor {legacy.name}; pass the directory (and "
                "prefix) given to save_optimizer(shard=True)."
            )
        path = index if index.is_file() else legacy
    if path.name.endswith(_INDEX_SUFFIX):
        optimizer.load_state_dict(_read_sharded(path))
    else:
        optimizer.load_state_dict(read_torch_file(path, where="load_optimizer", verify=False))
