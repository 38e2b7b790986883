# SPDX-License-Identifier: Apache-2.0
"""One-time notes about configurations that run an order of magnitude slower than an equivalent one."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from ._table import Precision, get_precision

__all__ = ["SlowConfigurationWarning", "warn_slow_precision"]


class SlowConfigurationWarning(UserWarning):
    """A configuration runs much slower than an equivalent one on this device (said once per process)."""


# (precision, device type) -> the note. The figure comes from tools/repro/cpu_precision_step.py, see there.
_SLOW: dict[tuple[str, str], str] = {
    ("fp16", "cpu"): (
        "{where}: precision 'fp16' runs on a CPU device, where torch emulates fp16 arithmetic: a LowLevelZeroPlugin"
        "(stage=2) training step took about 25x the time of precision='bf16' on a 2-core AMD EPYC (Zen 4). Pass "
        "precision='bf16' (no loss scaling needed) or 'fp32' unless fp16 itself is what you test."
    ),
}
# Measured 2026-11-25 with tools/repro/cpu_precision_step.py on a 2-core AMD EPYC (family 25 model 17, Zen 4:
# AVX-512 with AVX512_BF16, no AVX512_FP16), torch 2.13.0+cpu, 1 thread, width 256 x 2 layers, 256 rows, AdamW,
# median of 12 interleaved steps; load average ~17 from other jobs, so trust the ratios only:
# fp16 1819 ms/step, bf16 71.6 ms/step (fp16 25.4x bf16), fp32 122 ms/step (1.7x bf16).
# A second run: fp16 1459 ms, bf16 50.6 ms (28.8x), fp32 87.1 ms. The Booster's fp16 autocast with
# plugin='single' (same model, AdamW): fp16 1851 ms, bf16 64.6 ms (28.7x), fp32 110 ms.

_said: set[tuple[str, str]] = set()
_lock = threading.Lock()


def warn_slow_precision(precision: str | Precision | None, device: Any, *, where: str) -> bool:
    """Warn (:class:`SlowConfigurationWarning`, once per process for each precision and device type) when
    ``precision`` is known to be emulated, and so an order of magnitude slower, on ``device``.

    Called by the Booster at ``boost`` with the precision in effect (the plugin's, else its mixed
    precision) and the plugin's device, so every plugin (strategy's and stepforge-zero's) gets it.

    Args:
        precision: a precision name or table row (``None``: fp32).
        device: a ``torch.device`` or a device string.
        where: who is configured (``"Booster.boost(plugin='zero2')"``), the start of the message.

    Returns:
        Whether the note was emitted by this call.
    """
    if precision is None:
        return False
    name = get_precision(precision, owner=where).runs_as
    key = (name, torch.device(device).type)
    template = _SLOW.get(key)
    if template is None:
        return False
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    warnings.warn(template.format(where=where), SlowConfigurationWarning, stacklevel=3)
    return True
