# SPDX-License-Identifier: Apache-2.0
"""AMP unscale planning: what every gradient is divided by in a step, where GradScaler's ``grad_scale`` and
``found_inf`` are read, and whether ``p.grad`` must be left unscaled afterwards (torch's fused contract).

``torch.amp.GradScaler`` calls ``step()`` without unscaling (``_step_supports_amp_scaling``) and sets
``grad_scale`` / ``found_inf`` on the optimizer. Host values are read at once; CUDA tensors stay on the device
for the sync-free path and are read only if the step falls back to the host loop (HybridAdam's mixed buckets).
After a step that is not skipped the grads hold ``g / scale``, as torch's fused optimizers leave them: written
back by the kernel in the same pass when it divides by exactly the scale, otherwise in a second pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from stepforge.core import HyperParameterError, check_range

from ._buckets import Bucket
from ._protocol import KernelOwner
from ._validate import local_tensor

__all__ = ["AmpUnscaler", "UnscalePlan"]


@dataclass(slots=True)
class UnscalePlan:
    """One step's division of the gradients.

    Attributes:
        divisor: host divisor of every grad (``div_scale`` x a host GradScaler scale).
        unscale_by: GradScaler's scale when it was read on the host (``p.grad`` must end as ``g / unscale_by``).
        grad_scale: GradScaler's scale still on a device (sync-free path), else None.
        found_inf: GradScaler's overflow flag still on a device, else None.
        skip: a host ``found_inf`` is raised: the step is skipped before anything is read.
    """

    divisor: float
    unscale_by: float | None = None
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    skip: bool = False

    def check_divisor(self, owner: str) -> None:
        """Refuse a non-positive or non-finite total divisor (a GradScaler scale of 0 or inf)."""
        if not math.isfinite(self.divisor) or self.divisor <= 0:
            raise HyperParameterError(
                f"{owner}: the gradient divisor must be positive and finite, got {self.divisor}"
            )

    def to_host(self) -> bool:
        """Read the device-resident GradScaler values (the host loop decides skips on the host); returns
        whether the step is skipped (``found_inf`` raised)."""
        if self.found_inf is not None and float(self.found_inf) != 0.0:
            return True
        self.found_inf = None
        if self.grad_scale is not None:
            scale = float(self.grad_scale)
            self.unscale_by = scale * (self.unscale_by or 1.0)
            self.divisor *= scale
            self.grad_scale = None
        return False

    def kernel_writes_back(self, divisor: float) -> bool:
        """Whether the kernels, dividing by ``divisor``, can store ``g / scale`` in the same pass."""
        return self.unscale_by is not None and divisor == self.unscale_by


class AmpUnscaler:
    """Plans the division of each step (:class:`UnscalePlan`) and does the second unscale pass when the
    kernels divided by more than GradScaler's scale (``div_scale``, LAMB's clip)."""

    __slots__ = ()

    @staticmethod
    def divisor(opt: KernelOwner, div_scale: float | None) -> float:
        """The host divisor given by ``step(div_scale=)``: ``-1`` (or None) is none; anything else must be
        positive and finite (``HyperParameterError`` otherwise, before the closure runs)."""
        if div_scale is None or div_scale == -1:
            return 1.0
        return check_range(
            "div_scale",
            div_scale,
            low=0.0,
            low_open=True,
            high=math.inf,
            high_open=True,
            owner=f"{opt._owner}.step()",
            hint="It divides every gradient (a loss scale); pass -1 (the default) for no division.",
        )

    @staticmethod
    def plan(
        opt: KernelOwner,
        divisor: float,
        grad_scale: torch.Tensor | float | None,
        found_inf: torch.Tensor | float | None,
    ) -> UnscalePlan:
        """The step's plan: GradScaler's values that live on the host (or on a device without the sync-free
        path) are read now, device tensors are kept for the device loop."""
        plan = UnscalePlan(divisor)
        if found_inf is not None and not (
            isinstance(found_inf, torch.Tensor) and opt._device_path(found_inf.device)
        ):
            if float(found_inf) != 0.0:
                plan.skip = True
                return plan
            found_inf = None
        if grad_scale is not None and not (
            isinstance(grad_scale, torch.Tensor) and opt._device_path(grad_scale.device)
        ):
            plan.unscale_by = float(grad_scale)
            plan.divisor *= plan.unscale_by
            grad_scale = None
        plan.grad_scale = grad_scale
        plan.found_inf = found_inf
        return plan

    @staticmethod
    def unscale_grads(buckets: list[Bucket], unscale_by: float) -> None:
        """Second pass: divide every grad of ``buckets`` by GradScaler's scale."""
        for b in buckets:
            grads = [local_tensor(cast(torch.Tensor, p.grad)) for p in b.params]  # bucketed: has a grad
            if grads:
                torch._foreach_div_(grads, unscale_by)
