# SPDX-License-Identifier: Apache-2.0
"""stepforge.accum: gradient accumulation that is exact, cheap and hard to misuse.

Two APIs over one window logic:

- mmengine's :class:`OptimWrapper` (``update_params``, ``optim_context``, ``initialize_count_status``, ...),
  registered as ``OptimWrapper`` in ``stepforge.core.OPTIM_WRAPPERS``;
- ColossalAI's :func:`accumulate_gradient` family (:class:`GradAccumOptimizer`, :class:`GradAccumDataloader`,
  :class:`GradAccumLrSchedulerByStep`, :class:`GradAccumGradientHandler`).

Beyond both: ``num_items``/``weight`` normalisation (exact window mean over tokens or samples, summed across
data-parallel ranks with one small all-reduce per window), counters in every ``state_dict``, ``no_sync`` for
DDP, FSDP2 and ZeRO optimizers through :func:`stepforge.core.no_sync`, and warnings/errors on misuse.

Extending: :class:`OptimWrapper` exposes its :class:`AccumulationWindow` as ``window`` and documented hooks
(``run_backward``, ``before_clip``, ``clip_gradients``, ``optimizer_step``, ``no_sync_context``) that a subclass
overrides to change how backward, clipping, the step or the gradient-sync suspension run (the package README,
"Extending OptimWrapper").
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
