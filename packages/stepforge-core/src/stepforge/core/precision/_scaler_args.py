# SPDX-License-Identifier: Apache-2.0
"""The one validation of dynamic-loss-scaler arguments (the scaler, fp16 mixed precision and every plugin)."""

from __future__ import annotations

import math
from typing import Any, TypedDict

from ..errors import HyperParameterError

__all__ = ["LossScalerArgs", "validate_loss_scaler_args", "LOSS_SCALER_DEFAULTS"]


class LossScalerArgs(TypedDict):
    """Validated arguments of :class:`~stepforge.core.precision.DynamicLossScaler` (ColossalAI's names)."""

    initial_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    max_scale: float
    hysteresis: int


#: ``torch.amp.GradScaler``'s defaults, plus ColossalAI's bounds; hysteresis 1 backs off on every overflow
#: (GradScaler's rule). ColossalAI's plugins pass their own (``growth_interval=1000``, ``hysteresis=2``).
LOSS_SCALER_DEFAULTS = LossScalerArgs(
    initial_scale=2.0**16,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    min_scale=1.0,
    max_scale=2.0**32,
    hysteresis=1,
)


def _number(owner: str, name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise HyperParameterError(f"{owner}: {name} must be a finite number, got {value!r}.")
    return float(value)


def _count(owner: str, name: str, value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HyperParameterError(f"{owner}: {name} must be an int >= 1, got {value!r}.")
    return value


def validate_loss_scaler_args(
    owner: str,
    *,
    initial_scale: Any = None,
    growth_factor: Any = None,
    backoff_factor: Any = None,
    growth_interval: Any = None,
    min_scale: Any = None,
    max_scale: Any = None,
    hysteresis: Any = None,
    init_scale: Any = None,
) -> LossScalerArgs:
    """Check the dynamic loss scaler's arguments and return them as floats/ints (``None``: the default).

    ``init_scale`` (``torch.amp.GradScaler``'s spelling) is an alias of ``initial_scale``.

    Rules: ``0 < min_scale <= initial_scale <= max_scale``, ``growth_factor > 1``, ``0 < backoff_factor < 1``,
    ``growth_interval`` and ``hysteresis`` ints >= 1.

    Raises:
        HyperParameterError: the first bad argument, named with ``owner`` (the class the user called) and the
            allowed range.
    """
    scale_name = "initial_scale"
    if init_scale is not None:
        scale_name = "init_scale"  # name what the caller passed
        if initial_scale is not None:
            raise HyperParameterError(
                f"{owner}: initial_scale and init_scale are the same argument (init_scale is GradScaler's "
                f"spelling); pass one of them, got initial_scale={initial_scale!r}, init_scale={init_scale!r}."
            )
        initial_scale = init_scale
    d = LOSS_SCALER_DEFAULTS
    initial = _number(owner, scale_name, initial_scale, d["initial_scale"])
    low = _number(owner, "min_scale", min_scale, d["min_scale"])
    high = _number(owner, "max_scale", max_scale, d["max_scale"])
    growth = _number(owner, "growth_factor", growth_factor, d["growth_factor"])
    backoff = _number(owner, "backoff_factor", backoff_factor, d["backoff_factor"])
    if not low > 0:
        raise HyperParameterError(f"{owner}: min_scale must be > 0, got {min_scale!r}.")
    if not high >= low:
        raise HyperParameterError(f"{owner}: max_scale must be >= min_scale ({low:g}), got {max_scale!r}.")
    if not low <= initial <= high:
        raise HyperParameterError(
            f"{owner}: {scale_name} must lie in [min_scale, max_scale] = [{low:g}, {high:g}], got {initial:g}."
        )
    if not growth > 1:
        raise HyperParameterError(f"{owner}: growth_factor must be > 1, got {growth_factor!r}.")
    if not 0 < backoff < 1:
        raise HyperParameterError(f"{owner}: backoff_factor must be in (0, 1), got {backoff_factor!r}.")
    return LossScalerArgs(
        initial_scale=initial,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=_count(owner, "growth_interval", growth_interval, d["growth_interval"]),
        min_scale=low,
        max_scale=high,
        hysteresis=_count(owner, "hysteresis", hysteresis, d["hysteresis"]),
    )
