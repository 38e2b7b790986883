# SPDX-License-Identifier: Apache-2.0
"""Dynamic loss scaling for fp16 (ColossalAI's ``DynamicGradScaler`` semantics, with its state checkpointed).

- An overflowing step decrements the hysteresis budget and resets the clean-step count; when the budget is
  spent the scale backs off (``scale * backoff_factor``, never below ``min_scale``) and the budget refills.
- ``growth_interval`` clean steps in a row grow the scale (``* growth_factor``, never above ``max_scale``)
  and refill the budget.

Unlike ColossalAI's scaler, the whole state (scale, clean-step count, remaining hysteresis, counters) is in
``state_dict()``, and the hysteresis budget refills on back-off too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stepforge.core import HyperParameterError

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """The loss scale and its update rule.

    Args:
        initial_scale: the first scale (> 0).
        min_scale, max_scale: bounds of the scale (``0 < min_scale <= max_scale``).
        growth_factor: > 1. backoff_factor: in (0, 1).
        growth_interval: clean steps before a growth (>= 1).
        hysteresis: overflows tolerated before a back-off (>= 1).
    """

    def __init__(
        self,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
    ) -> None:
        owner = "LowLevelZeroOptimizer"
        if not min_scale > 0:
            raise HyperParameterError(f"{owner}: min_scale must be > 0, got {min_scale!r}.")
        if not max_scale >= min_scale:
            raise HyperParameterError(
                f"{owner}: max_scale must be >= min_scale ({min_scale!r}), got {max_scale!r}."
            )
        if not min_scale <= initial_scale <= max_scale:
            raise HyperParameterError(
                f"{owner}: initial_scale must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}], "
                f"got {initial_scale!r}."
            )
        if not growth_factor > 1:
            raise HyperParameterError(f"{owner}: growth_factor must be > 1, got {growth_factor!r}.")
        if not 0 < backoff_factor < 1:
            raise HyperParameterError(f"{owner}: backoff_factor must be in (0, 1), got {backoff_factor!r}.")
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HyperParameterError(f"{owner}: {name} must be an int >= 1, got {value!r}.")
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.scale = float(initial_scale)
        self.growth_tracker = 0  # clean steps since the last growth or overflow
        self.hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        """Record one step: ``overflow`` says whether its gradients held an inf or a NaN."""
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.growth_tracker = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the scale, its counters and its configuration."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_left": self.hysteresis_left,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (missing configuration keys keep the current values)."""
        if "scale" not in state:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: the loss-scaler state has no 'scale' key; pass the 'loss_scaler' entry "
                "of a LowLevelZeroOptimizer state dict."
            )
        for key in (
            "min_scale",
            "max_scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "hysteresis",
        ):
            if key in state:
                setattr(self, key, type(getattr(self, key))(state[key]))
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
