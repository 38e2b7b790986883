# SPDX-License-Identifier: Apache-2.0
"""The plugins of stepforge-strategy, registered in ``stepforge.plugins``:

========================= ============================ =========================================================
registry names            class                        torch engine
========================= ============================ =========================================================
``single``                :class:`SinglePlugin`        none (one process)
``torch_ddp``, ``ddp``    :class:`TorchDDPPlugin`      ``DistributedDataParallel``
``torch_fsdp``, ``fsdp``  :class:`TorchFSDPPlugin`     FSDP2 ``fully_shard`` + ``MixedPrecisionPolicy``
``gemini``                :class:`GeminiPlugin`        FSDP2 ``fully_shard`` + ``CPUOffloadPolicy`` (ZeRO-3)
========================= ============================ =========================================================

Each subclasses :class:`stepforge.core.PluginBase` (re-exported here as ``PluginBase``) and returns an
:class:`~stepforge.strategy.OptimizerWrapper` (a :class:`stepforge.core.BoostedOptimizer`) from ``prepare``.
"""

from __future__ import annotations

from stepforge.core import PluginBase  # the shared base of every plugin lives in stepforge-core

from .gemini import GeminiPlugin
from .single import SinglePlugin
from .torch_ddp import TorchDDPPlugin
from .torch_fsdp import TorchFSDPPlugin

__all__ = ["PluginBase", "SinglePlugin", "TorchDDPPlugin", "TorchFSDPPlugin", "GeminiPlugin"]
