# SPDX-License-Identifier: Apache-2.0
"""Optimizer and lr-scheduler save/load for the Booster.

The optimizer goes through ``torch.distributed.checkpoint``: the plugin's ``get_state_dict`` gives tensors (or
DTensors) keyed by parameter FQN, every rank writes its own shard, and ``dcp.load`` fills the same structure
in place at load time, at any world size. The fp16 loss-scaler state (``grad_scaler``, the boosted optimizer's
``scaler_state_dict()``) rides along. Saves go through the one checkpoint writer (``checkpoint.commit_dir`` for
the optimizer directory, ``checkpoint.commit_file`` for the scheduler file); loads check its manifest first. The plugin and the optimizer meet here only through
:class:`stepforge.core.Plugin` and :class:`stepforge.core.BoostedOptimizer`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
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
from .checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    begin_dir,
    commit_dir,
    commit_file,
    finish_dir,
    safe_dcp_load,
    verify_dir,
    verify_file,
)
from .checkpoint._staging import fresh_like

__all__ = ["PendingCommit", "save_optimizer", "load_optimizer", "save_lr_scheduler", "load_lr_scheduler"]


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
) -> Any:
    """Write the optimizer state of every rank to directory ``checkpoint`` (collective).

    ``use_async``: ``dcp.async_save`` (the state is staged before it returns); returns the future of the
    background write, which the caller waits on (``.result()``). Otherwise ``None`` after the write."""
    _, optim_sd = plugin.get_state_dict(model, optimizer)
    state: dict[str, Any] = {"optimizer": saved_optimizer_state(optimizer, optim_sd)}
    scaler = optimizer.scaler_state_dict()
    if scaler is not None:
        state["grad_scaler"] = scaler
    meta = {"kind": "optimizer"}
    if not use_async:

        def write(tmp: str) -> None:
            with _single_process_quiet():
                dcp.save(state, checkpoint_id=tmp)

        commit_dir(checkpoint, write, meta=meta, arg="checkpoint", where="save_optimizer")
        return None
    final, tmp = begin_dir(checkpoint, arg="checkpoint", where="save_optimizer")
    with _single_process_quiet():
        pending = dcp.async_save(state, checkpoint_id=tmp)
    # torch >= 2.9 returns an AsyncSaveResponse (its upload_completion is the future), older a Future
    return PendingCommit(getattr(pending, "upload_completion", pending), final, tmp, meta, "save_optimizer")


class PendingCommit(Future):  # type: ignore[type-arg]
    """The future of an asynchronous directory save: waiting on it (``exception()``/``result()``, on every rank,
    in the same order: ColossalAI's ``_sync_io`` points) waits for the background write, then commits the
    directory through the one writer (collective), or removes it and raises :class:`CheckpointError`."""

    def __init__(self, write: Any, final: str, tmp: str, meta: dict[str, Any], where: str) -> None:
        super().__init__()
        self._write, self._final, self._tmp, self._meta, self._where = write, final, tmp, meta, where

    def _settle(self) -> None:
        if self.done():
            return
        local: BaseException | None = None
        try:
            self._write.result()
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            local = exc
        try:
            self.set_result(finish_dir(self._final, self._tmp, local, meta=self._meta, where=self._where))
        except CheckpointError as exc:
            self.set_exception(exc)

    def result(self, timeout: float | None = None) -> Any:
        self._settle()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._settle()
        return super().exception(timeout)


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
    safe_dcp_load(fresh, str(path), no_dist=not _is_dist())  # no code runs from the files (CheckpointError)
    plugin.set_state_dict(model, optimizer, model_sd, fresh["optimizer"])
    if scaler is not None:
        optimizer.load_scaler_state_dict(fresh["grad_scaler"])


def save_lr_scheduler(lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
    """``torch.save(lr_scheduler.state_dict())`` on rank 0; every rank calls (it ends with a barrier)."""
    if not hasattr(lr_scheduler, "state_dict"):
        raise TypeError(f"save_lr_scheduler: {type(lr_scheduler).__name__} has no state_dict().")
    state = lr_scheduler.state_dict()

    def write(tmp: str) -> None:
        torch.save(state, tmp)

    commit_file(checkpoint, write, arg="checkpoint", where="save_lr_scheduler", meta={"kind": "lr_scheduler"})


def load_lr_scheduler(lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
    """Load a file written by :func:`save_lr_scheduler` (``CheckpointError`` when it holds anything but plain
    values and tensors: no code runs from the file)."""
    verify_file(str(checkpoint))  # the sidecar manifest's size and CRC-32, when the file has one
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
