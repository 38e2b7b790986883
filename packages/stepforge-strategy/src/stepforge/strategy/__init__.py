# SPDX-License-Identifier: Apache-2.0
"""stepforge.strategy: ColossalAI's Booster and mmengine's strategy layer on torch's own engines (the package
README maps every name)."""

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
from .launch import DistCoordinator, launch, launch_from_torch
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
