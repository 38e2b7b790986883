# SPDX-License-Identifier: Apache-2.0
"""stepforge.accum: gradient accumulation that is exact, cheap and hard to misuse.

Two APIs over one window logic:

- mmengine's :class:`OptimWrapper` (``update_params``, ``optim_context``, ``initialize_count_status``, ...),
  registered as ``OptimWrapper`` in ``stepforge.core.OPTIM_WRAPPERS``;
- ColossalAI's :func:`accumulate_gradient` family (:class:`GradAccumOptimizer`, :class:`GradAccumDataloader`,
  :class:`GradAccumLrSchedulerByStep`, :class:`GradAccumGradientHandler`).

Beyond both: the exact window mean over tokens or samples across ranks (``num_items``/``weight``), counters in
every ``state_dict``, ``no_sync`` for DDP, FSDP2 and ZeRO optimizers, warnings and errors on misuse, and hooks
for subclasses (the package README, "Extending OptimWrapper").
"""

from __future__ import annotations

from ._version import __version__
from ._window import (
    AccumulatingOptimizer,
    AccumulationError,
    AccumulationWarning,
    AccumulationWindow,
    scale_gradients,
)
from .grad_accum import (
    GradAccumDataloader,
    GradAccumGradientHandler,
    GradAccumOptimizer,
    accumulate_gradient,
)
from .lr_scheduler import GradAccumLrSchedulerByStep
from .optim_wrapper import OptimWrapper

__all__ = [
    "__version__",
    "OptimWrapper",
    "accumulate_gradient",
    "GradAccumDataloader",
    "GradAccumOptimizer",
    "GradAccumLrSchedulerByStep",
    "GradAccumGradientHandler",
    "AccumulationWindow",
    "AccumulatingOptimizer",
    "AccumulationError",
    "AccumulationWarning",
    "scale_gradients",
]
