# SPDX-License-Identifier: Apache-2.0
"""Reference SGD with momentum: a plain loop over parameters, in fp32 (fp64 for fp64 tensors), apex form.

For every tensor ``i``::

    g = g / grad_scale                          # grad_scale is the loss scale (divided out)
    g = -g                                      # only if maximize
    g = g + wd * p                              # only if not wd_after_momentum
    if momentum != 0:
        buf = g                 if first_run[i]
        buf = mu * buf + (1 - dampening) * g     otherwise
        g   = g + mu * buf      if nesterov else buf
    g = g + wd * p                              # only if wd_after_momentum (apex option)
    p = p - lr * g

With ``wd_after_momentum=False`` this is ``torch.optim.SGD`` exactly (the first step copies ``g`` into the
buffer without dampening). ``first_run`` is *per tensor*: apex passes one flag per launch, which is wrong when
new and old parameters share a launch (see reference/optimizers.md §1.5); the reference does not copy that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import Any

import torch

from ._util import check_lists, math_dtype_for, run_closure, to_math, write_back

__all__ = ["reference_sgd_step", "ReferenceSGD"]


@torch.no_grad()
def reference_sgd_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: MutableSequence[torch.Tensor | None],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    wd_after_momentum: bool = False,
    first_run: Sequence[bool] | None = None,
    grad_scale: float = 1.0,
    maximize: bool = False,
    math_dtype: torch.dtype | None = None,
) -> None:
    """One SGD step on every tensor, in place.

    Args:
        params: parameters (any float dtype/device); updated in place.
        grads: gradients; read only.
        momentum_buffers: one entry per tensor; ``None`` entries are replaced by a new buffer (fp32, fp64 for
            fp64 params) when ``momentum != 0``. Existing buffers are updated in place.
        lr, momentum, dampening, nesterov, weight_decay: as ``torch.optim.SGD``.
        wd_after_momentum: add ``wd*p`` after the momentum update instead of before (apex ``FusedSGD``).
        first_run: per tensor, initialise the buffer from ``g`` (ignoring its content). Default: ``True``
            exactly where the buffer is ``None``. A ``None`` buffer with ``first_run=False`` starts from zeros.
        grad_scale: the loss scale; gradients are divided by it first.
        maximize: ascend instead of descend.
        math_dtype: compute dtype (default fp32, fp64 for fp64 tensors).
    """
    n = check_lists(
        "reference_sgd_step",
        params=params,
        grads=grads,
        momentum_buffers=momentum_buffers,
        first_run=first_run,
    )
    for i in range(n):
        dtype = math_dtype_for(params[i], math_dtype)
        p = to_math(params[i], dtype)
        g = to_math(grads[i], dtype) / grad_scale
        if maximize:
            g = -g
        if weight_decay != 0 and not wd_after_momentum:
            g = g + weight_decay * p
        if momentum != 0:
            existing = momentum_buffers[i]
            first = existing is None if first_run is None else bool(first_run[i])
            if first:
                buf = g.clone()
            else:
                old = torch.zeros_like(p) if existing is None else to_math(existing, dtype)
                buf = momentum * old + (1.0 - dampening) * g
            if existing is None:
                momentum_buffers[i] = buf.to(
                    torch.float64 if params[i].dtype == torch.float64 else torch.float32
                )
            else:
                write_back(existing, buf)
            g = g + momentum * buf if nesterov else buf
        if weight_decay != 0 and wd_after_momentum:
            g = g + weight_decay * p
        write_back(params[i], p - lr * g)


class ReferenceSGD(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` around :func:`reference_sgd_step`.

    State per parameter: ``momentum_buffer`` (fp32; fp64 for fp64 params), created on the first step with a
    gradient when ``momentum != 0``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        wd_after_momentum: bool = False,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = run_closure(closure)
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            bufs: list[torch.Tensor | None] = [self.state[p].get("momentum_buffer") for p in ps]
            reference_sgd_step(
                ps,
                [p.grad for p in ps],
                bufs,
                lr=group["lr"],
                momentum=group["momentum"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                wd_after_momentum=group["wd_after_momentum"],
                maximize=group["maximize"],
            )
            if group["momentum"] != 0:
                for p, buf in zip(ps, bufs, strict=True):
                    self.state[p]["momentum_buffer"] = buf
        return loss
