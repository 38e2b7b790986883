# SPDX-License-Identifier: Apache-2.0
"""Optimizer and lr-scheduler save/load for the Booster.

The optimizer goes through ``torch.distributed.checkpoint``: the plugin's ``get_state_dict`` gives tensors (or
DTensors) keyed by parameter FQN, every rank writes its own shard, and ``dcp.load`` fills the same structure
in place at load time, at any world size. The fp16 loss-scaler state (``grad_scaler``, the boosted optimizer's
``scaler_state_dict()``) rides along. The plugin and the optimizer meet here only through
:class:`stepforge.core.Plugin` and :class:`stepforge.core.BoostedOptimizer`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from stepforge.core import BoostedOptimizer, Plugin
from stepforge.core.plugin_base import unwrap_optimizer

from ._optim_template import complete_template, saved_optimizer_state
from .checkpoint import MARKER, CheckpointError, CheckpointMismatchError, safe_dcp_load
from .checkpoint._dcp import verify_files
from .checkpoint._staging import fresh_like

__all__ = ["save_optimizer", "load_optimizer", "save_lr_scheduler", "load_lr_scheduler"]


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP saves/loads in this process and warns each time; that is the intent here."""
    with warnings.catch_warnings():
        if not _is_dist():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_optimizer(
    plugin: Plugin,
    model: nn.Module,
    optimizer: BoostedOptimizer,
    checkpoint: str | os.PathLike[str],
    *,
    use_async: bool = False,
) -> None:
    """Write the optimizer state of every rank to directory ``checkpoint`` (collective)."""
    _, optim_sd = plugin.get_state_dict(model, optimizer)
    state: dict[str, Any] = {"optimizer": saved_optimizer_state(optimizer, optim_sd)}
    scaler = optimizer.scaler_state_dict()
    if scaler is not None:
        state["grad_scaler"] = scaler
    Path(checkpoint).mkdir(parents=True, exist_ok=True)
    with _single_process_quiet():
        if use_async:
            pending = dcp.async_save(state, checkpoint_id=str(checkpoint))
            # torch >= 2.9 returns an AsyncSaveResponse (its upload_completion is the future), older a Future
            completion: Any = getattr(pending, "upload_completion", pending)
            completion.result()
        else:
            dcp.save(state, checkpoint_id=str(checkpoint))


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
    if (path / MARKER).is_file():  # a committed directory: its manifest's sizes and checksums first
        verify_files(str(path))
    model_sd, optim_sd = plugin.get_state_dict(model, optimizer)
    # every saved entry gets a place (or CheckpointMismatchError, a ValueError) before any tensor is read
    complete_template(optim_sd, path, unwrap_optimizer(optimizer))
    state: dict[str, Any] = {"optimizer": optim_sd}
    scaler = optimizer.scaler_state_dict()
    if scaler is not None:
        state["grad_scaler"] = scaler
    fresh = fresh_like(state)  # read into fresh tensors: a failed read leaves the optimizer as it was
    safe_dcp_load(fresh, str(path), no_dist=not _is_dist())  # no code runs from the files (CheckpointError)
    plugin.set_state_dict(model, optimizer, model_sd, fresh["optimizer"])
    if scaler is not None:
        optimizer.load_scaler_state_dict(fresh["grad_scaler"])


def save_lr_scheduler(lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
    """``torch.save(lr_scheduler.state_dict())`` on rank 0; every rank calls (it ends with a barrier)."""
    if not hasattr(lr_scheduler, "state_dict"):
        raise TypeError(f"save_lr_scheduler: {type(lr_scheduler).__name__} has no state_dict().")
    if not _is_dist() or dist.get_rank() == 0:
        path = Path(checkpoint)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(lr_scheduler.state_dict(), tmp)
        os.replace(tmp, path)
    if _is_dist():
        dist.barrier()


def load_lr_scheduler(lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
    """Load a file written by :func:`save_lr_scheduler` (``CheckpointError`` when it holds anything but plain
    values and tensors: no code runs from the file)."""
    try:
        state = torch.load(Path(checkpoint), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CheckpointError(f"load_lr_scheduler: {checkpoint} is unreadable or refused ({exc})") from exc
    live = set(lr_scheduler.state_dict())
    if not isinstance(state, dict) or set(state) != live:
        theirs = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointMismatchError(
            f"load_lr_scheduler: {checkpoint} holds {theirs}, {type(lr_scheduler).__name__} has {sorted(live)}: "
            "it was saved from another scheduler type; nothing was loaded"
        )
    lr_scheduler.load_state_dict(state)
