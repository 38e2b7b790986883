# SPDX-License-Identifier: Apache-2.0
"""Optimizer and lr-scheduler save/load for the Booster.

The optimizer goes through ``torch.distributed.checkpoint``: the plugin's ``get_state_dict`` gives tensors (or
DTensors) keyed by parameter FQN, every rank writes its own shard, and ``dcp.load`` fills the same structure
in place at load time, at any world size. The fp16 loss-scaler state (``grad_scaler``, the boosted optimizer's
``scaler_state_dict()``) rides along. Saves go through the one checkpoint writer (``commit_dir`` for the optimizer
directory, written by ``_dcp.dcp_save`` as every DCP save; ``commit_file`` for the scheduler file); an
asynchronous save runs on the background writer (``_pending.py``). Loads check the manifest first. The plugin
and the optimizer meet here only through :class:`stepforge.core.Plugin` and
:class:`stepforge.core.BoostedOptimizer`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from stepforge.core import BoostedOptimizer, Plugin, unwrap_optimizer

from .._env import is_distributed
from ._dcp import dcp_save, safe_dcp_load
from ._layout import CheckpointMismatchError
from ._optim_template import complete_template, saved_optimizer_state
from ._pending import PendingWrites, async_save_group
from ._sidecar import read_torch_file
from ._staging import fresh_like
from ._writer import begin_dir, commit_dir, commit_file, finish_dir, verify_dir

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


def save_optimizer(
    plugin: Plugin,
    model: nn.Module,
    optimizer: BoostedOptimizer,
    checkpoint: str | os.PathLike[str],
    *,
    pending: PendingWrites | None = None,
) -> None:
    """Write the optimizer state of every rank to directory ``checkpoint`` (collective).

    ``pending`` (an asynchronous save): the state is staged (copied to CPU) and the directory begun here; the
    DCP write and the commit run on the background writer (``_pending.py``), on its own process group."""
    state = _saved_state(plugin, model, optimizer)
    if pending is None:

        def write(tmp: str) -> None:
            dcp_save(state, tmp)

        commit_dir(checkpoint, write, meta=_META, arg="checkpoint", where="save_optimizer")
        return
    copy = BlockingAsyncStager().stage(state)  # a CPU copy (DTensors stay DTensors): what the writer reads
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
    """Fill ``optimizer`` from a directory written by :func:`save_optimizer` (collective).

    Every saved entry is restored, those a fresh optimizer lacks included (as torch's ``load_state_dict``
    does); a checkpoint of other parameters raises ``ValueError`` before anything is loaded.
    """
    path = Path(checkpoint)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"load_optimizer: {path} is not a torch.distributed.checkpoint directory (no .metadata); pass the "
            "directory given to save_optimizer."
        )
    # COMMIT.json and every file's CRC-32 first; a directory without one (torch's own dcp.save, or a save of
    # stepforge before the one writer) is read as before, through the restricted reader only
    verify_dir(str(path), required=False, where="load_optimizer")
    model_sd, optim_sd = plugin.get_state_dict(model, optimizer)
    # every saved entry gets a place (or CheckpointMismatchError, a ValueError) before any tensor is read
    complete_template(optim_sd, path, unwrap_optimizer(optimizer))
    state: dict[str, Any] = {"optimizer": optim_sd}
    scaler = optimizer.scaler_state_dict()
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

    def write(tmp: str) -> None:
        torch.save(state, tmp)

    commit_file(checkpoint, write, arg="checkpoint", where="save_lr_scheduler", meta={"kind": "lr_scheduler"})


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
