# SPDX-License-Identifier: Apache-2.0
"""``DynamicLossScaler``: ``torch.amp.GradScaler``'s dynamic loss scaling, for plain and DTensor gradients.

Same rule and ``state_dict`` keys as ``GradScaler`` (``scale``, ``growth_factor``, ``backoff_factor``,
``growth_interval``, ``_growth_tracker``), plus ColossalAI's ``min_scale``, ``max_scale`` and ``hysteresis``
(overflows tolerated before the scale backs off). Unlike ``GradScaler`` it unscales FSDP2's DTensor
gradients through their local shards, and with a process group the overflow verdict is all-reduced so
that every rank skips the same steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import dtensor_local

__all__ = ["DynamicLossScaler"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return dtensor_local(t)


class DynamicLossScaler:
    """Dynamic loss scaling.

    Args:
        init_scale: the first scale.
        growth_factor: multiplier after ``growth_interval`` overflow-free steps (> 1).
        backoff_factor: multiplier after an overflow (in (0, 1)); the overflowing step is skipped.
        growth_interval: overflow-free steps before growing.
        min_scale: the scale never goes below this.
        max_scale: the scale never goes above this.
        hysteresis: overflows in a row before the scale backs off (1 = every overflow, as GradScaler).
        process_group: ranks that must agree on skipping (sharded gradients); ``None``: this process only.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**32,
        hysteresis: int = 1,
        process_group: Any = None,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"DynamicLossScaler: init_scale must be > 0, got {init_scale!r}.")
        if not growth_factor > 1:
            raise ValueError(f"DynamicLossScaler: growth_factor must be > 1, got {growth_factor!r}.")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"DynamicLossScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}.")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(
                f"DynamicLossScaler: growth_interval must be an int >= 1, got {growth_interval!r}."
            )
        if not 0 < min_scale <= max_scale:
            raise ValueError(
                f"DynamicLossScaler: need 0 < min_scale <= max_scale, got min_scale={min_scale!r}, "
                f"max_scale={max_scale!r}."
            )
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"DynamicLossScaler: hysteresis must be an int >= 1, got {hysteresis!r}.")
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.hysteresis = hysteresis
        self.process_group = process_group
        self._growth_tracker = 0
        self._hysteresis_left = hysteresis
        self.found_inf = False

    def get_scale(self) -> float:
        return self._scale

    def scale(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor * scale``."""
        return tensor * self._scale

    def unscale_(self, optimizer: Any) -> bool:
        """Divide every gradient of ``optimizer`` by the scale; return whether any rank found inf/NaN."""
        inv = 1.0 / self._scale
        flags: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = _local(p.grad)
                flags.append((~torch.isfinite(g)).any().reshape(1).to("cpu", torch.float32))
                g.mul_(inv)
        found = torch.cat(flags).amax() if flags else torch.zeros(())
        if self.process_group is not None and dist.is_available() and dist.is_initialized():
            comm = found.reshape(1).to(_comm_device(self.process_group))
            dist.all_reduce(comm, op=dist.ReduceOp.MAX, group=self.process_group)
            found = comm.cpu()
        self.found_inf = bool(found.item() > 0)
        return self.found_inf

    def update(self) -> None:
        """Back off after an overflow (``hysteresis`` of them in a row), grow after a clean interval."""
        if self.found_inf:
            self._growth_tracker = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
                self._hysteresis_left = self.hysteresis
        else:
            self._hysteresis_left = self.hysteresis
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale = min(self._scale * self.growth_factor, self.max_scale)
                self._growth_tracker = 0
        self.found_inf = False

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys plus ``min_scale``, ``max_scale``, ``hysteresis``, ``_hysteresis_left``."""
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
            "_hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict` (a ``GradScaler`` state dict loads too)."""
        if "scale" not in state:
            raise ValueError("DynamicLossScaler.load_state_dict: the state has no 'scale'.")
        self._scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._growth_tracker = int(state.get("_growth_tracker", 0))
        self.min_scale = float(state.get("min_scale", self.min_scale))
        self.max_scale = float(state.get("max_scale", self.max_scale))
        self.hysteresis = int(state.get("hysteresis", self.hysteresis))
        self._hysteresis_left = int(state.get("_hysteresis_left", self.hysteresis))


def _comm_device(group: Any) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
