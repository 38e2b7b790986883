# SPDX-License-Identifier: Apache-2.0
"""stepforge.zero: ZeRO sharded optimizers for ``torch.distributed`` (gloo on CPU, NCCL on GPU).

- :class:`ZeroRedundancyOptimizer`: mmengine's string-typed ZeRO-1 on torch's
  ``torch.distributed.optim.ZeroRedundancyOptimizer``; the local optimizer is any registered name
  (``"AdamW"``, ``"FusedAdam"``, ``"Lamb"``), and a ``state_dict()`` called from only some ranks fails in bounded
  time instead of hanging.
"""

from __future__ import annotations

from ._version import __version__
from .zero_redundancy import DEFAULT_CONSOLIDATE_TIMEOUT, CollectiveCallError, ZeroRedundancyOptimizer

__all__ = [
    "__version__",
    "CollectiveCallError",
    "DEFAULT_CONSOLIDATE_TIMEOUT",
    "ZeroRedundancyOptimizer",
]
