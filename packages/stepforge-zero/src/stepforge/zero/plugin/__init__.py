# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroPlugin`` for the Booster of stepforge-strategy (``plugin="low_level_zero"``, ``"zero1"``,
``"zero2"``).

- :mod:`.low_level_zero`: the plugin (ColossalAI's signature) and ``Zero1Plugin``/``Zero2Plugin``.
- :mod:`.model`: :class:`LowLevelZeroModel`, the prepared model (working dtype, input casting, waits for the
  optimizer's parameter gather) and the precision table.
- :mod:`.memory_plan`: what a rank holds and sends under the plugin, from the optimizer's own code on meta tensors.
- :mod:`.lora`: peft adapters join the optimizer built over the base model.
"""

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
