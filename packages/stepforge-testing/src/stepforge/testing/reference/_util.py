# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the reference optimizers: math dtype, step counters, in-place write-back."""

from __future__ import annotations

from collections.abc import Callable, MutableSequence, Sequence
from typing import Any

import torch

__all__ = [
    "math_dtype_for",
    "advance_step",
    "check_lists",
    "to_math",
    "write_back",
    "run_closure",
    "adam_moments",
]


def math_dtype_for(tensor: torch.Tensor, math_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the reference computes in for ``tensor``.

    ``math_dtype`` wins when given; otherwise fp64 tensors stay fp64 and everything else (fp32, fp16, bf16) is
    computed in fp32, which is what every fused kernel does (``MATH_T=float``).
    """
    if math_dtype is not None:
        return math_dtype
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def to_math(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A private copy of ``tensor`` in ``dtype`` (always a copy, so the input is never aliased)."""
    return tensor.detach().to(dtype=dtype, copy=True)


def write_back(dst: torch.Tensor, value: torch.Tensor) -> None:
    """Round ``value`` to ``dst``'s dtype and store it in place."""
    dst.copy_(value.to(dst.dtype))


def advance_step(steps: MutableSequence[int | torch.Tensor], index: int) -> int:
    """Increment ``steps[index]`` in place (an ``int`` entry is replaced, a tensor is ``add_``-ed) and return it."""
    current = steps[index]
    if isinstance(current, torch.Tensor):
        current.add_(1)
        return int(current.item())
    steps[index] = int(current) + 1
    return int(steps[index])


def check_lists(owner: str, **lists: Sequence[object] | None) -> int:
    """All non-``None`` lists have one length; return it."""
    lengths = {name: len(values) for name, values in lists.items() if values is not None}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{owner}: the tensor lists must have one length each, got {lengths}")
    return next(iter(lengths.values()), 0)


def run_closure(closure: Callable[[], float] | None) -> float | None:
    """torch.optim's closure rule: re-evaluate the loss with grad enabled (``step`` itself runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def adam_moments(
    state: dict[Any, dict[str, Any]], group: dict[str, Any]
) -> tuple[
    list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int | torch.Tensor]
]:
    """``(params with a grad, their grads, exp_avgs, exp_avg_sqs, steps)`` of one param group, creating zero
    moments (fp32, or fp64 for fp64 params) and ``step = 0`` on a parameter's first step."""
    ps: list[torch.Tensor] = []
    gs: list[torch.Tensor] = []
    ms: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    steps: list[int | torch.Tensor] = []
    for p in group["params"]:
        if p.grad is None:
            continue
        gs.append(p.grad)
        entry = state[p]
        if not entry:
            sdtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            entry["step"] = 0
            entry["exp_avg"] = torch.zeros_like(p, dtype=sdtype)
            entry["exp_avg_sq"] = torch.zeros_like(p, dtype=sdtype)
        ps.append(p)
        ms.append(entry["exp_avg"])
        vs.append(entry["exp_avg_sq"])
        steps.append(entry["step"])
    return ps, gs, ms, vs, steps
