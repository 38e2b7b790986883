# SPDX-License-Identifier: Apache-2.0
"""stepforge.zero: ZeRO sharded optimizers for ``torch.distributed`` (gloo on CPU, NCCL on GPU).

- :class:`ZeroRedundancyOptimizer`: mmengine's string-typed ZeRO-1 on torch's
  ``torch.distributed.optim.ZeroRedundancyOptimizer``; the local optimizer is any registered name
  (``"AdamW"``, ``"FusedAdam"``, ``"Lamb"``), and a ``state_dict()`` called from only some ranks fails in bounded
  time instead of hanging.
- :class:`LowLevelZeroOptimizer`: ZeRO-1/2 around any built optimizer (flat padded pieces, bucketed gradient
  reductions from backward hooks, fp32 masters, fp16 loss scaling, CPU offload, ``no_sync`` for both stages,
  DCP-sharded and full state dicts); see ``docs/low_level.md``.
- :class:`LowLevelZeroPlugin` (``plugin="low_level_zero"``, ``"zero1"``, ``"zero2"``): ColossalAI's plugin
  signature for the Booster of stepforge-strategy.
"""

from __future__ import annotations

from ._version import __version__
from .low_level import LowLevelZeroOptimizer
from .plugin import (
    PRECISIONS,
    LowLevelZeroModel,
    LowLevelZeroPlugin,
    UnsupportedPrecisionError,
    Zero1Plugin,
    Zero2Plugin,
)
from .zero_redundancy import (
    DEFAULT_CONSOLIDATE_TIMEOUT,
    CollectiveCallError,
    MissingArgumentError,
    ZeroRedundancyOptimizer,
)

__all__ = [
    "__version__",
    "CollectiveCallError",
    "DEFAULT_CONSOLIDATE_TIMEOUT",
    "LowLevelZeroModel",
    "LowLevelZeroOptimizer",
    "LowLevelZeroPlugin",
    "MissingArgumentError",
    "PRECISIONS",
    "UnsupportedPrecisionError",
    "Zero1Plugin",
    "Zero2Plugin",
    "ZeroRedundancyOptimizer",
]
