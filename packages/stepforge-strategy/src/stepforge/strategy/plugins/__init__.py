# SPDX-License-Identifier: Apache-2.0
"""The plugins of stepforge-strategy, registered in ``stepforge.plugins``: ``single`` (:class:`SinglePlugin`, one
process), ``torch_ddp``/``ddp`` (:class:`TorchDDPPlugin`, ``DistributedDataParallel``), ``torch_fsdp``/``fsdp``
(:class:`TorchFSDPPlugin`, FSDP2 ``fully_shard``) and ``gemini`` (:class:`GeminiPlugin`, FSDP2 with
``CPUOffloadPolicy``), each returning an :class:`~stepforge.strategy.OptimizerWrapper`; ``Plugin`` and
``DPPluginBase`` are ColossalAI's base classes (:mod:`.colossalai_base`)."""

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
