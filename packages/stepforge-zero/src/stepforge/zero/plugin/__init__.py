# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroPlugin`` for the Booster of stepforge-strategy (``plugin="low_level_zero"``, ``"zero1"``,
``"zero2"``): the plugin (:mod:`.low_level_zero`), the prepared model (:mod:`.model`), its memory plan
(:mod:`.memory_plan`) and peft adapters (:mod:`.lora`)."""

from __future__ import annotations

from .low_level_zero import LowLevelZeroPlugin, Zero1Plugin, Zero2Plugin
from .model import PRECISIONS, LowLevelZeroModel, UnsupportedPrecisionError

__all__ = [
    "LowLevelZeroPlugin",
    "LowLevelZeroModel",
    "Zero1Plugin",
    "Zero2Plugin",
    "UnsupportedPrecisionError",
    "PRECISIONS",
]
