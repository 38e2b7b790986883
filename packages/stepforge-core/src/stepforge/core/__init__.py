# SPDX-License-Identifier: Apache-2.0
"""stepforge.core: the thin interface every stepforge package talks through.

Registries filled from entry points (:data:`OPTIMIZERS`, :data:`PLUGINS`, :data:`OPTIM_WRAPPERS`) and
:func:`build_optimizer`; the training contract (:class:`Plugin`, an abstract base class after ColossalAI's, and
the :class:`BoostedOptimizer` protocol every plugin's ``prepare`` returns); the protocols objects meet through
and :func:`no_sync`; :class:`MemoryPlan` (what :meth:`Plugin.memory_plan` says one rank holds and communicates);
validation helpers whose messages name the parameter and the allowed range. :mod:`stepforge.core.torch_compat`
wraps the torch internals once, so a torch update breaks one module, not six packages; its names are imported
from there (``from stepforge.core.torch_compat import dtensor_local``), not from here.
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
