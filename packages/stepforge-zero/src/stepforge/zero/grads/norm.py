# SPDX-License-Identifier: Apache-2.0
"""The gradient norm over every rank's pieces, and torch's clipping rule applied to the pieces."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError

__all__ = ["check_clip_args", "global_norm", "clip_"]


def check_clip_args(max_norm: float, norm_type: float) -> float:
    """Validate ``clip_grad_norm_``'s arguments; returns ``norm_type`` as a float."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
        raise HyperParameterError(f"clip_grad_norm_: max_norm must be a number > 0, got {max_norm!r}.")
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise HyperParameterError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}.")
    return norm_type


def global_norm(
    grads: list[torch.Tensor],
    norm_type: float,
    all_reduce: Callable[[torch.Tensor, dist.ReduceOp | dist.ReduceOp.RedOpType], torch.Tensor],
) -> torch.Tensor:
    """The ``norm_type``-norm of the concatenation of every rank's ``grads`` (fp32 scalar tensor).

    Partial sums are taken in float64 and combined with one one-element all-reduce (SUM, or MAX for inf).
    """
    zero = torch.zeros((), dtype=torch.float64)
    if math.isinf(norm_type):
        local = max((g.abs().max().double().cpu() for g in grads), default=zero)
        total = all_reduce(local.reshape(1), dist.ReduceOp.MAX)[0]
    else:
        local = sum(
            (torch.linalg.vector_norm(g, norm_type, dtype=torch.float64).cpu() ** norm_type for g in grads),
            zero,
        )
        total = all_reduce(local.reshape(1), dist.ReduceOp.SUM)[0] ** (1.0 / norm_type)
    return total.float()


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_``'s rule: multiply by ``min(1, max_norm / (norm + 1e-6))``."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device, grad.dtype))
