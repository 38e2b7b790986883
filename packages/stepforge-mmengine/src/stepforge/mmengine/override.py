# SPDX-License-Identifier: Apache-2.0
"""Importing this module replaces mmengine's ColossalAI entries with stepforge's (an explicit opt-in).

``custom_imports=dict(imports=["stepforge.mmengine.override"], allow_failed_imports=False)`` makes
``dict(type="CPUAdam")``, ``dict(type="HybridAdam")``, ``dict(type="ColossalAIOptimWrapper")`` and
``strategy=dict(type="ColossalAIStrategy")`` resolve to stepforge's classes (see
:mod:`stepforge.mmengine.registration`).
"""

from __future__ import annotations

from .registration import register_all

__all__: list[str] = []

register_all(override=True)
