# SPDX-License-Identifier: Apache-2.0
"""torch's private base classes: ``nn.modules.batchnorm._NormBase`` (layers with running statistics) and
``torch.optim.lr_scheduler._LRScheduler`` (the scheduler base ColossalAI's code checks with
``isinstance``)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["LegacyLRScheduler", "is_norm_with_running_stats"]


def is_norm_with_running_stats(module: Any) -> bool:
    """Whether ``module`` is a BatchNorm, SyncBatchNorm or InstanceNorm layer (lazy ones included): a layer
    whose forward may update running statistics."""
    return isinstance(module, nn.modules.batchnorm._NormBase)


#: ``torch.optim.lr_scheduler._LRScheduler`` (a subclass of the public ``LRScheduler``), or ``LRScheduler`` on a
#: torch without the old name. Subclass it to pass ``isinstance(x, _LRScheduler)`` checks of ColossalAI code.
try:
    from torch.optim.lr_scheduler import _LRScheduler as LegacyLRScheduler
except ImportError:  # pragma: no cover - a torch that dropped the old name: LRScheduler is what remains
    from torch.optim.lr_scheduler import LRScheduler as LegacyLRScheduler  # type: ignore[assignment]
