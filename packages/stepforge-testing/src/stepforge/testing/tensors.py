# SPDX-License-Identifier: Apache-2.0
"""Tensor helpers shared by the optimizer test suites (twins of parameters, gradients, exact comparisons)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["bits_equal", "clone_params", "make_params", "set_grads"]


def make_params(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype = torch.float32, *, seed: int | None = None
) -> list[torch.nn.Parameter]:
    """Parameters of the given shapes filled from ``randn`` (``seed``: a private generator)."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def clone_params(params: Iterable[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Independent copies (own storage, same values and dtype) of ``params``."""
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(
    *param_lists: Sequence[torch.Tensor], dtype: torch.dtype | None = None, scale: float = 1.0
) -> None:
    """Give the i-th parameter of every list the same fresh random gradient (``dtype``: the grads' dtype)."""
    for ps in zip(*param_lists, strict=True):
        g = torch.randn(ps[0].shape).to(dtype or ps[0].dtype) * scale
        for p in ps:
            if g.dtype != p.dtype:
                p.grad_dtype = None  # torch >= 2.10 rejects a grad of another dtype unless asked
            p.grad = g.clone()


def bits_equal(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    """Whether two sequences of tensors are elementwise identical (``torch.equal`` each, same length)."""
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(list(a), list(b), strict=True))
