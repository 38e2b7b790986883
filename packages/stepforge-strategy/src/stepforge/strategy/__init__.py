# SPDX-License-Identifier: Apache-2.0
"""stepforge.strategy."""

from __future__ import annotations

from ._version import __version__
from .checkpoint import CheckpointError, find_latest_checkpoint
from .strategy import ColossalAIStrategy, Strategy

__all__ = [
    "__version__",
    "Strategy",
    "ColossalAIStrategy",
    "CheckpointError",
    "find_latest_checkpoint",
]
