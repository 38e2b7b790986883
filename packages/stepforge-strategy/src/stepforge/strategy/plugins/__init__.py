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

Each subclasses :class:`stepforge.core.Plugin` and returns
an :class:`~stepforge.strategy.OptimizerWrapper` (a :class:`stepforge.core.BoostedOptimizer`) from ``prepare``.

``Plugin`` and ``DPPluginBase`` here are ColossalAI's base classes (``colossalai.booster.plugin``), for plugins
written ColossalAI's way (:mod:`.colossalai_base`).
"""

from __future__ import annotations

from .colossalai_base import DPPluginBase, Plugin
from .gemini import GeminiPlugin
from .single import SinglePlugin
from .torch_ddp import TorchDDPPlugin
from .torch_fsdp import TorchFSDPPlugin

__all__ = [
    "Plugin",
    "DPPluginBase",
    "SinglePlugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
    "GeminiPlugin",
]
