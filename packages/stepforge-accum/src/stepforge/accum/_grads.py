# SPDX-License-Identifier: Apache-2.0
"""Gradient helpers of the accumulation window: scaling what an optimizer will step with, and DDP's forward.

- :func:`scale_gradients` multiplies the gradients an optimizer steps with (weighted-mode normalisation);
- :func:`track_forward` records at each forward of a DDP model whether its coming backward will all-reduce,
  which is how a "no_sync around the backward only" mistake is detected;
- :func:`comm_device` is where a small collective's buffer must live for the group's backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stepforge.core import GradScalingOptimizer

__all__ = ["comm_device", "is_forward_armed", "scale_gradients", "track_forward"]


def is_forward_armed(target: Any) -> bool:
    """Whether ``target`` decides at *forward* time if the next backward synchronises (DDP does)."""
    return isinstance(target, DistributedDataParallel)


def _record_sync_at_forward(module: nn.Module, args: Any) -> None:
    # DDP reads this flag in its forward to arm (or not) the all-reduce of the coming backward.
    # mypy types nn.Module attributes as Tensor | Module (from __getattr__); this one is our bool flag.
    armed = bool(torch.is_grad_enabled() and module.require_backward_grad_sync)
    module._stepforge_armed = armed  # type: ignore[assignment]


def track_forward(target: Any) -> None:
    """Remember, at each forward of a DDP model, whether its next backward will all-reduce (once per model)."""
    if is_forward_armed(target) and getattr(target, "_stepforge_forward_hook", None) is None:
        target._stepforge_forward_hook = target.register_forward_pre_hook(_record_sync_at_forward)


def scale_gradients(optimizer: Any, factor: float) -> None:
    """Multiply every gradient ``optimizer`` will step with by ``factor``.

    A :class:`stepforge.core.GradScalingOptimizer` (a ZeRO-2 optimizer holding reduced pieces) scales its own.
    """
    if factor == 1.0:
        return
    if isinstance(optimizer, GradScalingOptimizer):
        optimizer.scale_grads_(factor)
        return
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return
    try:
        torch._foreach_mul_(grads, factor)
    except (RuntimeError, TypeError, NotImplementedError):  # mixed devices, DTensor/sparse mixes
        for grad in grads:
            grad.mul_(factor)


def comm_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
