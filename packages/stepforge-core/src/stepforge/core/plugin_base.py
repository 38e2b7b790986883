# SPDX-License-Identifier: Apache-2.0
"""``PluginBase``: the earlier name of :class:`stepforge.core.Plugin`, kept for the plugins and users that
subclass it. The contract and its implementation live in :mod:`stepforge.core.plugin`, once."""

from __future__ import annotations

from .plugin import Plugin, default_device
from .protocols import optimizer_list, unwrap_optimizer

__all__ = ["PluginBase", "default_device", "unwrap_optimizer", "optimizer_list"]

#: :class:`stepforge.core.Plugin` itself (the same class object, so ``issubclass`` and ``isinstance`` agree)
PluginBase = Plugin
