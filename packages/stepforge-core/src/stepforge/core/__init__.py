# SPDX-License-Identifier: Apache-2.0
"""stepforge.core: the thin interface every stepforge package talks through.

- :data:`OPTIMIZERS`, :data:`PLUGINS`, :data:`OPTIM_WRAPPERS`: registries filled from the entry-point groups
  ``stepforge.optimizers``, ``stepforge.plugins`` and ``stepforge.optim_wrappers``.
- :func:`build_optimizer`: ``build_optimizer(dict(type="FusedAdam", lr=1e-3), model)``; an unknown name says
  which distribution to install.
- Protocols (:class:`NoSyncModel`, :class:`GradientSyncSwitch`, :class:`ShardedOptimizer`,
  :class:`GradientHandler`, :class:`Plugin`) and :func:`no_sync`.
- Validation helpers whose messages name the parameter and the allowed range.
"""

from __future__ import annotations

from ._version import __version__
from .build import build_optimizer, collect_params
from .errors import DuplicateNameError, HyperParameterError, RegistryError, StepforgeError, UnknownNameError
from .protocols import GradientHandler, GradientSyncSwitch, NoSyncModel, Plugin, ShardedOptimizer
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
    "build_optimizer",
    "collect_params",
    "DuplicateNameError",
    "HyperParameterError",
    "RegistryError",
    "StepforgeError",
    "UnknownNameError",
    "GradientHandler",
    "GradientSyncSwitch",
    "NoSyncModel",
    "Plugin",
    "ShardedOptimizer",
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
