# SPDX-License-Identifier: Apache-2.0
"""What a :class:`~stepforge.strategy.Strategy` hands to its checkpoint code: the parts a checkpoint saves and
restores (its own module so that the save and the load side both import it and not each other)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from stepforge.accum import OptimWrapper
from stepforge.core import Plugin

__all__ = ["RunState"]


@dataclass
class RunState:
    """The parts of a run a checkpoint saves and restores, as the Strategy holds them.

    ``dispatch_kwargs`` is the Strategy's own dict (``resume`` sets its ``"cur_iter"``; its
    ``"train_micro_batch_size_per_gpu"`` gives the global batch); ``optim_wrapper`` is the accumulation wrapper
    whose ``optimizer`` is the boosted optimizer.
    """

    model: torch.nn.Module | None
    optim_wrapper: OptimWrapper | None
    plugin: Plugin
    mixed_precision: str | None  # the Booster's mixed precision, for a plugin that does not own precision
    param_schedulers: list[Any] | None
    statefuls: dict[str, tuple[Any, bool]]
    dispatch_kwargs: dict[str, Any]
    seed: int
    global_batch_size: int | None  # the run's Strategy(global_batch_size=...): kept across world sizes
    experiment_name: str
    world_size: int
    rank: int
    work_dir: str
    deterministic: bool
    config: Any
    logger: logging.Logger
