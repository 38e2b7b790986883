# SPDX-License-Identifier: Apache-2.0
"""``GeneralCheckpointIO``: ColossalAI's checkpoint IO for a plugin-less Booster (and for plain models and
optimizers on its own), on :class:`~stepforge.strategy.checkpoint_io.BoosterCheckpointIO`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import Plugin

from .checkpoint import CheckpointError
from .checkpoint_io import BoosterCheckpointIO, done_future, is_dist, rank, staged

__all__ = ["GeneralCheckpointIO", "OPTIM_FILE"]

#: the file a plain (not boosted) optimizer's state goes to inside a ``shard=True`` directory
OPTIM_FILE = "pytorch_optim.bin"


class GeneralCheckpointIO(BoosterCheckpointIO):
    """ColossalAI's ``GeneralCheckpointIO``: the checkpoint IO of a plugin-less Booster, also usable on its own
    (``GeneralCheckpointIO()``) for plain models and optimizers.

    Besides what :class:`BoosterCheckpointIO` does, it saves an optimizer that ``boost`` did not wrap (a plain
    ``torch.optim.Optimizer``): ``torch.save(optimizer.state_dict())`` on rank 0 to file ``checkpoint``
    (``shard=True``: directory ``checkpoint`` with ``[prefix-]pytorch_optim.bin``), loaded with
    ``weights_only`` and ``optimizer.load_state_dict`` (every saved state entry restored).

    Args:
        plugin: the Booster's plugin; ``None`` (standalone) uses ``single``.
    """

    def __init__(self, plugin: Plugin | None = None) -> None:
        if plugin is None:
            from .plugins.single import SinglePlugin

            plugin = SinglePlugin()
        super().__init__(plugin)

    @staticmethod
    def _plain_path(checkpoint: Any, shard: bool, prefix: str | None) -> Path:
        path = Path(checkpoint)
        if not shard:
            return path
        name = (
            f"{prefix}-{OPTIM_FILE}"
            if prefix and not prefix.endswith(("-", "_"))
            else f"{prefix or ''}{OPTIM_FILE}"
        )
        return path / name

    def _save_plain_optimizer(
        self, optimizer: Any, checkpoint: Any, shard: bool, prefix: str | None, use_async: bool
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"save_optimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        path = self._plain_path(checkpoint, shard, prefix)
        if rank() == 0:
            state = staged(optimizer.state_dict())
            if use_async:
                self._submit(_write_torch, state, path)
            else:
                _write_torch(state, path)
        elif use_async:
            self.async_writers.append(done_future())
        if not use_async and is_dist():
            dist.barrier()

    def _load_plain_optimizer(self, optimizer: Any, checkpoint: Any, prefix: str | None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"load_optimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        path = Path(checkpoint)
        if path.is_dir():
            if (path / ".metadata").is_file():
                raise ValueError(
                    f"load_optimizer: {path} is a torch.distributed.checkpoint save of a boosted optimizer; load "
                    "it into the optimizer Booster.boost returned."
                )
            path = self._plain_path(path, True, prefix)
        try:  # weights_only: no code runs from the file
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise CheckpointError(f"load_optimizer: {path} is unreadable or refused ({exc})") from exc
        optimizer.load_state_dict(state)


def _write_torch(state: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
