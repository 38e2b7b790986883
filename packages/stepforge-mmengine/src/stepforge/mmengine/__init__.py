# SPDX-License-Identifier: Apache-2.0
"""stepforge.mmengine: stepforge inside mmengine's ``Runner`` and ``FlexibleRunner``.

Importing it (``custom_imports=dict(imports=["stepforge.mmengine"], allow_failed_imports=False)`` in a config)
registers, in mmengine's registries:

- ``OPTIMIZERS``: every stepforge optimizer as ``Stepforge<Name>`` (``StepforgeCPUAdam``, ``StepforgeFusedAdam``,
  ``StepforgeLamb``...), names that never clash with mmengine's ColossalAI entries;
- ``OPTIM_WRAPPERS``: ``StepforgeColossalAIOptimWrapper``, ``StepforgeAmpOptimWrapper``, ``StepforgeOptimWrapper``;
- ``PARAM_SCHEDULERS``: stepforge's schedulers mmengine lacks (none with mmengine 0.10);
- ``STRATEGIES``: :class:`StepforgeStrategy` (and ``StepforgeColossalAIStrategy``) for ``FlexibleRunner``;
- ``MODEL_WRAPPERS``: :class:`StepforgeModelWrapper`.

``import stepforge.mmengine.override`` additionally takes over the ColossalAI names (``CPUAdam``,
``HybridAdam``, ``ColossalAIOptimWrapper``, ``ColossalAIStrategy``...). See :mod:`.registration`.
"""

from __future__ import annotations

from ._message_hub import PLAIN_FORMAT, message_hub_from_plain, message_hub_to_plain
from ._version import __version__
from .model_wrapper import StepforgeModelWrapper
from .registration import COLOSSALAI_NAMES, PREFIX, register_all, registered_names
from .strategy import StepforgeColossalAIStrategy, StepforgeStrategy

__all__ = [
    "__version__",
    "COLOSSALAI_NAMES",
    "PLAIN_FORMAT",
    "PREFIX",
    "StepforgeColossalAIStrategy",
    "StepforgeModelWrapper",
    "StepforgeStrategy",
    "message_hub_from_plain",
    "message_hub_to_plain",
    "register_all",
    "registered_names",
]

register_all()
