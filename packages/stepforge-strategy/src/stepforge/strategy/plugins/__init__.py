# SPDX-License-Identifier: Apache-2.0
"""The plugins of stepforge-strategy, registered in ``stepforge.plugins`` (``single``, ``torch_ddp``,
``torch_fsdp``, ``gemini``), and ColossalAI's base classes ``Plugin`` and ``DPPluginBase``."""

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
