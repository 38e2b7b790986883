# SPDX-License-Identifier: Apache-2.0
"""Optimizer and lr-scheduler save/load for the Booster.

Every plugin's ``get_state_dict`` gives the optimizer state in one layout: keyed by parameter FQN, each tensor
this rank's part of a tensor in its parameter's shape (a plain tensor, an FSDP2 ``DTensor``, a ZeRO
``FlatShard``). A sharded save (``shard=True``) goes through ``torch.distributed.checkpoint``: every rank writes
its own part, and ``dcp.load`` fills the template of any plugin at any world size. An unsharded save
(``shard=False``) is one ``torch.save`` file of the full state, gathered to rank 0 (ColossalAI's unsharded
optimizer save), that ``torch.load(weights_only=True)`` reads and any plugin at any world size loads: every rank
reads the file and copies out its part. The fp16 loss-scaler state (``grad_scaler``, the boosted optimizer's
``scaler_state_dict()``) rides along. Saves go through the one checkpoint writer (``commit_dir`` for the optimizer
directory, written by ``_dcp.dcp_save`` as every DCP save; ``commit_file`` for the scheduler file); an
asynchronous save runs on the background writer (``_pending.py``). Loads check the manifest first. The plugin
and the optimizer meet here only through :class:`stepforge.core.Plugin` and
:class:`stepforge.core.BoostedOptimizer`.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor

from stepforge.core import BoostedOptimizer, Plugin, unwrap_optimizer
from stepforge.core.flat_shard import FlatShard

from .._env import get_rank, is_distributed
from ._dcp import dcp_save, fresh_like, safe_dcp_load
from ._layout import CheckpointMismatchError, read_torch_file, verify_dir
from ._optim_template import fit_template, fit_template_to_state, saved_optimizer_state
from ._pending import PendingWrites, async_save_group, staged, write_on_rank0
from ._writer import begin_dir, commit_dir, commit_file, finish_dir, write_file

__all__ = [
    "save_optimizer",
    "load_optimizer",
    "save_lr_scheduler",
    "load_lr_scheduler",
]


def _saved_state(plugin: Plugin, model: nn.Module, optimizer: BoostedOptimizer) -> dict[str, Any]:
    _, optim_sd = plugin.get_state_dict(model, optimizer)
    state: dict[str, Any] = {"optimizer": saved_optimizer_state(optimizer, optim_sd)}
    scaler = optimizer.scaler_state_dict()
    if scaler is not None:
        state["grad_scaler"] = scaler
    return state


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
    state = _saved_state(plugin, model, optimizer)
    if not shard:
        full = _gathered(state)
        write = partial(
            write_file,
            checkpoint,
            partial(torch.save, full),
            arg="checkpoint",
            where="save_optimizer",
            meta=_META,
        )
        write_on_rank0(write, where="save_optimizer", pending=pending)
        return
    if pending is None:
        commit_dir(checkpoint, partial(dcp_save, state), meta=_META, arg="checkpoint", where="save_optimizer")
        return
    copy = staged(state)  # a CPU copy (DTensors and FlatShards keep their kind): what the writer reads
    final, tmp = begin_dir(checkpoint, arg="checkpoint", where="save_optimizer")
    group = async_save_group()

    def write_and_commit() -> str:
        local: BaseException | None = None
        try:
            dcp_save(copy, tmp, process_group=group)
        except (Exception, dcp.CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            local = exc
        return finish_dir(final, tmp, local, meta=_META, where="save_optimizer", group=group)

    pending.submit(write_and_commit, where="save_optimizer")


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
    if path.is_file():
        saved = read_torch_file(path, where="load_optimizer")  # no code runs from it (CheckpointError)
        if not isinstance(saved, dict) or "optimizer" not in saved:
            raise CheckpointMismatchError(
                f"load_optimizer: {path} holds no 'optimizer' entry; pass a file written by save_optimizer"
            )
        try:
            fit_template_to_state(optim_sd, saved["optimizer"], path, optimizer)
        except CheckpointMismatchError as exc:
            raise CheckpointMismatchError(f"load_optimizer: {exc}") from exc
        fresh = _fill(fresh_like({"optimizer": optim_sd}), {"optimizer": saved["optimizer"]})
        plugin.set_state_dict(model, optimizer, model_sd, fresh["optimizer"])
        if scaler is not None and saved.get("grad_scaler") is not None:
            optimizer.load_scaler_state_dict(saved["grad_scaler"])
        return
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"load_optimizer: {path} is neither a file of save_optimizer(shard=False) nor a "
            "torch.distributed.checkpoint directory (no .metadata); pass the path given to save_optimizer."
        )
    # COMMIT.json and every file's CRC-32 first; a directory without one (torch's own dcp.save, or a save of
    # stepforge before the one writer) is read as before, through the restricted reader only
    verify_dir(str(path), required=False, where="load_optimizer")
    # every saved entry gets a place (or CheckpointMismatchError, a ValueError) before any tensor is read
    try:
        fit_template(optim_sd, path, unwrap_optimizer(optimizer))
    except CheckpointMismatchError as exc:
        raise CheckpointMismatchError(f"load_optimizer: {exc}") from exc
    state: dict[str, Any] = {"optimizer": optim_sd}
    if scaler is not None:
        state["grad_scaler"] = scaler
    fresh = fresh_like(state)  # read into fresh tensors: a failed read leaves the optimizer as it was
    safe_dcp_load(
        fresh, str(path), no_dist=not is_distributed()
    )  # no code runs from the files (CheckpointError)
    plugin.set_state_dict(model, optimizer, model_sd, fresh["optimizer"])
    if scaler is not None:
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
