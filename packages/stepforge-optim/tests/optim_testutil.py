# SPDX-License-Identifier: Apache-2.0
"""Helpers for the stepforge-optim tests: run an optimizer and a reference on identical inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["make_params", "run_steps", "TOLERANCES"]

# Per dtype (rtol, atol) for 20-step trajectories: fp32 math in both, so only summation order and the order of
# scalar multiplications differ; low-precision parameters may round one ulp apart.
TOLERANCES = {
    torch.float64: (1e-9, 1e-11),
    torch.float32: (2e-5, 2e-6),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def make_params(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def run_steps(
    make_optimizer: Callable[[list[Any]], torch.optim.Optimizer],
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    *,
    steps: int,
    seed: int,
    grad_dtype: torch.dtype | None = None,
    groups: Callable[[list[torch.Tensor]], list[Any]] | None = None,
    grad_scale: float = 1.0,
    skip: Callable[[int, int], bool] | None = None,
) -> list[torch.Tensor]:
    """Build params, step ``steps`` times with seeded random gradients, return the final parameters.

    ``skip(step, index)`` leaves parameter ``index`` without a gradient at ``step``.
    """
    params = make_params(shapes, dtype, seed)
    if grad_dtype is not None and grad_dtype != dtype and hasattr(params[0], "grad_dtype"):
        for p in params:
            p.grad_dtype = None  # torch >= 2.10 refuses a grad of another dtype unless told to allow it
    opt = make_optimizer(groups(params) if groups else params)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * grad_scale
            p.grad = None if skip is not None and skip(step, i) else g.to(grad_dtype or dtype)
        opt.step()
    return [p.detach() for p in params]


def assert_trajectories_close(
    got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], dtype: torch.dtype
) -> None:
    rtol, atol = TOLERANCES[dtype]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)
