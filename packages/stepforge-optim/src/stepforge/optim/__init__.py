# SPDX-License-Identifier: Apache-2.0
"""stepforge.optim: pure-PyTorch LAMB and LARS with the known variants as explicit options.

>>> from stepforge.optim import Lamb, Lars
>>> opt = Lamb(model.parameters(), lr=1e-3, weight_decay=0.01)          # ColossalAI ``Lamb`` trajectory
>>> opt = Lamb.fused_lamb(model.parameters(), lr=1e-3)                   # apex ``FusedLAMB`` math
>>> opt = Lars(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4,
...            exclude_from_adaptation=Lars.exclude_bias_and_norm)

Both are registered as ``Lamb`` and ``Lars`` in the ``stepforge.optimizers`` entry-point group, so
``stepforge.core.build_optimizer(dict(type="Lamb", lr=1e-3), model)`` works.
"""

from __future__ import annotations

from ._lamb import Lamb
from ._lars import Lars
from ._version import __version__

__all__ = ["Lamb", "Lars", "__version__"]
