# SPDX-License-Identifier: Apache-2.0
"""stepforge.core: the thin interface every stepforge package talks through.

- :data:`OPTIMIZERS`, :data:`PLUGINS`, :data:`OPTIM_WRAPPERS`: registries filled from the entry-point groups
  ``stepforge.optimizers``, ``stepforge.plugins`` and ``stepforge.optim_wrappers``.
- :func:`build_optimizer`: ``build_optimizer(dict(type="FusedAdam", lr=1e-3), model)``; an unknown name says
  which distribution to install.
- The training contract: :class:`Plugin` (an abstract base class, ColossalAI's ``Plugin`` as the model; a new
  plugin is a class with ``name`` and ``prepare``, everything else has a default) and the :class:`BoostedOptimizer` protocol that every plugin's ``prepare`` returns (``backward(loss)`` is
  the only backward route).
- Protocols (:class:`NoSyncModel`, :class:`GradientSyncSwitch`, :class:`ShardedOptimizer`,
  :class:`GradientHandler`, :class:`WrappedModel`, :class:`CachingOptimizer`, and what gradient accumulation
  dispatches on: :class:`BackwardOptimizer`, :class:`ClippingOptimizer`, :class:`GradScalingOptimizer`) and
  :func:`no_sync`.
- :mod:`stepforge.core.memory_plan`: :class:`MemoryPlan`, what :meth:`Plugin.memory_plan` says one rank holds
  and communicates before anything is allocated, and :class:`OptimizerStateProbe` (state bytes read from the
  optimizer itself).
- Validation helpers whose messages name the parameter and the allowed range.
- :mod:`stepforge.core.torch_compat`: the torch internals (DTensor local shards, FSDP2 state, DCP key flattening,
  the DDP/FSDP2 ``no_sync`` adapters), wrapped once so a torch update breaks one module, not six packages; its
  names are imported from there (``from stepforge.core.torch_compat import dtensor_local``), not from here.
"""

from __future__ import annotations

from . import torch_compat
from ._optim_state import param_fqns
from ._version import __version__
from .build import build_optimizer, collect_params
from .errors import (
    DuplicateNameError,
    HyperParameterError,
    OptimizerStateError,
    RegistryError,
    StepforgeError,
    UnknownNameError,
)
from .memory_plan import MemoryPlan, OptimizerStateProbe, PlannedCollective, PlannedTensor
from .plugin import Plugin
from .protocols import (
    BackwardOptimizer,
    BoostedOptimizer,
    CachingOptimizer,
    ClippingOptimizer,
    GradientHandler,
    GradientSyncSwitch,
    GradScalingOptimizer,
    NoSyncModel,
    ShardedOptimizer,
    WrappedModel,
    optimizer_list,
    unwrap_optimizer,
)
from .registry import (
    INSTALL_HINTS,
    OPTIM_WRAPPERS,
    OPTIMIZERS,
    PLUGINS,
    Registry,
    RegistryEntry,
    normalize_name,
)
from .sync import no_sync, register_no_sync_adapter, supports_no_sync
from .validation import (
    GroupValidator,
    check_betas,
    check_bool,
    check_dampening,
    check_eps,
    check_float_dtype,
    check_grad,
    check_lr,
    check_momentum,
    check_nesterov,
    check_positive_int,
    check_range,
    check_trust_clip,
    check_weight_decay,
    validate_hyperparameters,
)

__all__ = [
    "__version__",
    "torch_compat",
    "build_optimizer",
    "collect_params",
    "param_fqns",
    "DuplicateNameError",
    "HyperParameterError",
    "OptimizerStateError",
    "RegistryError",
    "StepforgeError",
    "UnknownNameError",
    "GradientHandler",
    "GradientSyncSwitch",
    "NoSyncModel",
    "Plugin",
    "MemoryPlan",
    "PlannedTensor",
    "PlannedCollective",
    "OptimizerStateProbe",
    "BackwardOptimizer",
    "BoostedOptimizer",
    "CachingOptimizer",
    "ClippingOptimizer",
    "GradScalingOptimizer",
    "ShardedOptimizer",
    "WrappedModel",
    "optimizer_list",
    "unwrap_optimizer",
    "INSTALL_HINTS",
    "OPTIM_WRAPPERS",
    "OPTIMIZERS",
    "PLUGINS",
    "Registry",
    "RegistryEntry",
    "normalize_name",
    "no_sync",
    "register_no_sync_adapter",
    "supports_no_sync",
    "check_betas",
    "check_bool",
    "check_dampening",
    "check_eps",
    "check_float_dtype",
    "check_grad",
    "check_lr",
    "check_momentum",
    "check_nesterov",
    "check_positive_int",
    "check_range",
    "check_trust_clip",
    "check_weight_decay",
    "GroupValidator",
    "validate_hyperparameters",
]
