# SPDX-License-Identifier: Apache-2.0
"""Training loops shared by the test suites: the plain single-process references a run under test is compared
with, and optimizer trajectories driven by seeded random gradients.

- :func:`reference_windows`: one optimizer step per accumulation window, on one process, with no accumulation
  machinery: what gradient accumulation (any plugin, any world size) must reproduce.
- :func:`random_grads`, :func:`step_with_random_grads`: seeded gradients written into ``.grad`` and steps.
- :func:`trajectory_params`, :func:`run_steps`, :func:`assert_trajectories_close`: an optimizer and a
  reference stepped on identical parameters and gradients, compared with per-dtype tolerances.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .models import mse, snapshot

__all__ = [
    "TOLERANCES",
    "assert_trajectories_close",
    "random_grads",
    "reference_windows",
    "run_steps",
    "step_with_random_grads",
    "trajectory_params",
]

Batch = tuple[torch.Tensor, torch.Tensor]

# Per dtype (rtol, atol) for 20-step trajectories: fp32 math in both, so only summation order and the order of
# scalar multiplications differ; low-precision parameters may round one ulp apart.
TOLERANCES = {
    torch.float64: (1e-9, 1e-11),
    torch.float32: (2e-5, 2e-6),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def reference_windows(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    windows: Sequence[Sequence[Batch]],
    *,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = mse,
    concatenate: bool = True,
    max_norm: float | None = None,
    norms: list[float] | None = None,
) -> list[torch.Tensor]:
    """One ``optimizer`` step per window of micro-batches ``(x, y)``; returns the final parameters (copies).

    Args:
        windows: ``windows[w]`` is the list of micro-batches of optimizer step ``w`` (for a data-parallel run,
            every rank's micro-batches of that step).
        concatenate: ``True``: one ``loss_fn`` on the concatenated window (the mean over all its rows: what
            weighted accumulation equals); ``False``: one backward per micro-batch, gradients summed (what
            accumulation of per-micro-batch mean losses without normalisation equals).
        max_norm: clip the global L2 gradient norm (``torch.nn.utils.clip_grad_norm_``) before each step.
        norms: with ``max_norm``, each step's gradient norm before clipping is appended here (to check that the
            clip was active).
    """
    for window in windows:
        optimizer.zero_grad()
        if concatenate:
            xs = torch.cat([x for x, _ in window])
            ys = torch.cat([y for _, y in window])
            loss_fn(model, xs, ys).backward()
        else:
            for x, y in window:
                loss_fn(model, x, y).backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
            if norms is not None:
                norms.append(float(norm))
        optimizer.step()
    return snapshot(model)


def random_grads(params: Sequence[torch.Tensor], seed: int) -> None:
    """Give every parameter a standard normal gradient of its shape and dtype (generator seeded with ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def step_with_random_grads(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], steps: int, seed: int = 100
) -> None:
    """``steps`` optimizer steps, step ``k`` on :func:`random_grads` seeded with ``seed + k``."""
    for k in range(steps):
        random_grads(params, seed + k)
        optimizer.step()


def trajectory_params(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Leaf tensors (``requires_grad``) of the given shapes, drawn in float64 and rounded to ``dtype``."""
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
    """Build :func:`trajectory_params`, step ``steps`` times with seeded random gradients, return the final
    parameters.

    ``groups(params)``: the param groups to build the optimizer with; ``grad_dtype``: the gradients' dtype
    (default the parameters'); ``skip(step, index)`` leaves parameter ``index`` without a gradient at ``step``.
    """
    params = trajectory_params(shapes, dtype, seed)
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
    """Both trajectories end in ``dtype`` and agree within :data:`TOLERANCES` of ``dtype``."""
    rtol, atol = TOLERANCES[dtype]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)
