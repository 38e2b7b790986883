# SPDX-License-Identifier: Apache-2.0
"""stepforge.core.precision: the one precision table and the one dynamic loss scaler of stepforge.

- :data:`PRECISIONS` (``fp32``, ``fp16``, ``bf16``, ``fp8``, ``fp16_apex`` and their aliases), read by
  :func:`get_precision` and :func:`check_plugin_precision`;
- :class:`DynamicLossScaler`: ``torch.amp.GradScaler``'s state-dict keys and surface, ColossalAI's argument names
  and hysteresis, overflow agreed over a process group; :func:`validate_loss_scaler_args` checks its arguments
  (plugins call it at construction too);
- :func:`warn_slow_precision`: a one-time :class:`SlowConfigurationWarning` for a precision emulated on the
  device (fp16 on CPU).
"""

from __future__ import annotations

from ._loss_scaler import (
    LOSS_SCALER_DEFAULTS,
    STATE_KEYS,
    DynamicLossScaler,
    LossScalerArgs,
    validate_loss_scaler_args,
)
from ._slow import SlowConfigurationWarning, warn_slow_precision
from ._table import (
    MIXED_PRECISIONS,
    PLUGIN_PRECISIONS,
    PRECISIONS,
    Precision,
    check_plugin_precision,
    get_precision,
)

__all__ = [
    "Precision",
    "PRECISIONS",
    "PLUGIN_PRECISIONS",
    "MIXED_PRECISIONS",
    "get_precision",
    "check_plugin_precision",
    "DynamicLossScaler",
    "STATE_KEYS",
    "LossScalerArgs",
    "LOSS_SCALER_DEFAULTS",
    "validate_loss_scaler_args",
    "SlowConfigurationWarning",
    "warn_slow_precision",
]
