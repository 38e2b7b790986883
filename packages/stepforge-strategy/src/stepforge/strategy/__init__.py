# SPDX-License-Identifier: Apache-2.0
"""stepforge.strategy: ColossalAI's Booster and mmengine's strategy layer on torch's own engines.

- :class:`Booster` (``boost``, ``backward``, ``no_sync``, ``save_*``/``load_*``) with plugins from
  ``stepforge.core.PLUGINS`` (each a :class:`stepforge.core.Plugin` subclass): ``single``, ``torch_ddp``,
  ``torch_fsdp``, ``gemini`` here, ``low_level_zero`` from stepforge-zero;
- :class:`ModelWrapper` (the boosted model) and :class:`OptimizerWrapper`, the
  :class:`stepforge.core.BoostedOptimizer` these plugins return; :class:`CheckpointIO` /
  :class:`GeneralCheckpointIO` (``booster.checkpoint_io``) and :class:`Accelerator`;
- mixed precision (``"fp16"``, ``"bf16"``, ``"fp8"``, ``"fp16_apex"``);
- :class:`ColossalAIOptimWrapper` and :class:`AmpOptimWrapper` (``stepforge.core.OPTIM_WRAPPERS``);
- :class:`StatefulDataLoader` (the data position in checkpoints);
- :class:`Strategy` / :class:`ColossalAIStrategy` (mmengine's API: ``prepare``, ``save_checkpoint``,
  ``load_checkpoint``, ``resume``) with crash-safe DCP directory checkpoints (:mod:`.checkpoint`) and
  mmengine-semantics parameter schedulers (:mod:`.schedulers`);
- what ColossalAI's scripts call around the Booster: :func:`launch_from_torch` / :func:`launch`,
  :class:`DistCoordinator`, :func:`get_accelerator` / :func:`set_accelerator`, and its plugin base classes
  ``Plugin`` / :class:`DPPluginBase` (:mod:`.plugins`).
- :func:`estimate` / :class:`Estimate` (:mod:`.memory`): memory per rank (device and host, per component, peak)
  and bytes communicated per step of a configuration, before launch, from the plugins' own layout code; the
  console command ``stepforge-estimate``.
"""

from __future__ import annotations

from stepforge.core.precision import DynamicLossScaler

from ._version import __version__
from .accelerator import Accelerator, get_accelerator, set_accelerator
from .boosted_model import ModelWrapper
from .boosted_optimizer import OptimizerWrapper
from .booster import Booster
from .checkpoint import CheckpointError, find_latest_checkpoint
from .checkpoint_io import BoosterCheckpointIO, CheckpointIO, GeneralCheckpointIO
from .data import StatefulDataLoader, make_stateful
from .dist_coordinator import DistCoordinator
from .launch import launch, launch_from_torch
from .lazy import LazyInitContext
from .memory import Estimate, MemoryBudgetError, estimate
from .mixed_precision import (
    BF16MixedPrecision,
    FP8MixedPrecision,
    FP16ApexMixedPrecision,
    FP16TorchMixedPrecision,
    MixedPrecision,
    resolve_mixed_precision,
)
from .optim_wrappers import AmpOptimWrapper, ColossalAIOptimWrapper
from .plugins import DPPluginBase, GeminiPlugin, SinglePlugin, TorchDDPPlugin, TorchFSDPPlugin
from .strategy import ColossalAIStrategy, Strategy

__all__ = [
    "__version__",
    "Booster",
    "Accelerator",
    "get_accelerator",
    "set_accelerator",
    "launch",
    "launch_from_torch",
    "LazyInitContext",
    "DistCoordinator",
    "DPPluginBase",
    "ModelWrapper",
    "CheckpointIO",
    "BoosterCheckpointIO",
    "GeneralCheckpointIO",
    "OptimizerWrapper",
    "StatefulDataLoader",
    "make_stateful",
    "MixedPrecision",
    "FP16TorchMixedPrecision",
    "FP16ApexMixedPrecision",
    "BF16MixedPrecision",
    "FP8MixedPrecision",
    "resolve_mixed_precision",
    "ColossalAIOptimWrapper",
    "AmpOptimWrapper",
    "SinglePlugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
    "GeminiPlugin",
    "DynamicLossScaler",
    "Strategy",
    "ColossalAIStrategy",
    "CheckpointError",
    "find_latest_checkpoint",
    "estimate",
    "Estimate",
    "MemoryBudgetError",
]
