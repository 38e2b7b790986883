# SPDX-License-Identifier: Apache-2.0
"""Runner set-ups shared by the tests: the example config, loaded with per-run overrides."""

from __future__ import annotations

import copy
import os
import sys

import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

EXAMPLE_DIR = os.path.join(os.environ.get("STEPFORGE_SOURCE_ROOT", os.getcwd()), "examples", "mmengine")
CONFIG = os.path.join(EXAMPLE_DIR, "zero2_cpuadam.py")


def example_config(**overrides: object) -> Config:
    """The example's FlexibleRunner config with ``overrides`` applied (top-level keys)."""
    if EXAMPLE_DIR not in sys.path:
        sys.path.insert(0, EXAMPLE_DIR)
    cfg = Config.fromfile(CONFIG)
    for key, value in overrides.items():
        cfg[key] = copy.deepcopy(value)
    return cfg


class Crash(RuntimeError):
    """Raised by :class:`CrashAfterIter` to stop a run the way a killed job stops."""


@HOOKS.register_module(force=True)
class CrashAfterIter(Hook):
    """Raise :class:`Crash` after iteration ``at`` (runs after CheckpointHook: lowest priority)."""

    priority = "LOWEST"

    def __init__(self, at: int) -> None:
        self.at = at

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if runner.iter + 1 == self.at:
            raise Crash(f"stopped after iteration {self.at}")


@HOOKS.register_module(force=True)
class CountIters(Hook):
    """Records the iterations this runner trained (``runner.iter`` before each)."""

    priority = "LOWEST"

    def __init__(self) -> None:
        self.iters: list[int] = []

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        self.iters.append(runner.iter)


def module_state(runner) -> dict[str, torch.Tensor]:
    """The raw model's parameters and buffers, cloned to CPU."""
    return {k: v.detach().clone().cpu() for k, v in runner.model.module.state_dict().items()}


def counted_iters(runner) -> list[int]:
    """The iterations the runner's :class:`CountIters` hook saw."""
    return next(h for h in runner.hooks if isinstance(h, CountIters)).iters
