# SPDX-License-Identifier: Apache-2.0
"""Reference Adam / AdamW: a plain loop over parameters, in fp32 (fp64 for fp64 tensors), in the apex form.

For every tensor ``i`` (``t`` is its step after the increment)::

    g   = g / grad_scale                        # grad_scale is the loss scale (divided out)
    g   = -g                                    # only if maximize
    g   = g + wd * p                            # L2 mode only (adamw_mode=False)
    m   = beta1 * m + (1 - beta1) * g
    v   = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1**t ; bc2 = 1 - beta2**t     # both 1 when bias_correction=False
    u   = (m / bc1) / (sqrt(v / bc2) + eps)
    u   = u + wd * p                            # AdamW mode only (decoupled decay on the pre-update p)
    p   = p - lr * u

This is the math of apex/ColossalAI/DeepSpeed ``FusedAdam`` and of the CPU Adam kernels, and equals
``torch.optim.Adam`` (``adamw_mode=False``) and ``torch.optim.AdamW`` (``adamw_mode=True``) up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import Any

import torch

from ._util import adam_moments, advance_step, check_lists, math_dtype_for, run_closure, to_math, write_back

__all__ = ["reference_adam_step", "ReferenceAdam"]


@torch.no_grad()
def reference_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: MutableSequence[int | torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    grad_scale: float = 1.0,
    maximize: bool = False,
    math_dtype: torch.dtype | None = None,
) -> None:
    """One Adam/AdamW step on every tensor, in place.

    Args:
        params: parameters (any float dtype, any device); updated in place, rounded to their own dtype.
        grads: gradients, same shapes as ``params``; read only.
        exp_avgs, exp_avg_sqs: first and second moments (fp32 or the param dtype); updated in place.
        steps: steps taken so far, one per tensor (``int`` or a 0-dim tensor); each is incremented in place
            before use, so pass ``0`` for a fresh parameter.
        lr, beta1, beta2, eps, weight_decay: hyper-parameters (see the module docstring for the formulas).
        adamw_mode: ``True``: decoupled decay (``u += wd*p``); ``False``: L2 (``g += wd*p``).
        bias_correction: divide the moments by ``1 - beta**t``.
        grad_scale: the loss scale; gradients are divided by it first.
        maximize: ascend instead of descend.
        math_dtype: compute dtype (default fp32, fp64 for fp64 tensors).
    """
    n = check_lists(
        "reference_adam_step",
        params=params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        steps=steps,
    )
    for i in range(n):
        dtype = math_dtype_for(params[i], math_dtype)
        p, m, v = to_math(params[i], dtype), to_math(exp_avgs[i], dtype), to_math(exp_avg_sqs[i], dtype)
        g = to_math(grads[i], dtype) / grad_scale
        if maximize:
            g = -g
        t = advance_step(steps, i)
        if not adamw_mode and weight_decay != 0:
            g = g + weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        bc1 = 1.0 - beta1**t if bias_correction else 1.0
        bc2 = 1.0 - beta2**t if bias_correction else 1.0
        u = (m / bc1) / (torch.sqrt(v / bc2) + eps)
        if adamw_mode and weight_decay != 0:
            u = u + weight_decay * p
        p = p - lr * u
        write_back(params[i], p)
        write_back(exp_avgs[i], m)
        write_back(exp_avg_sqs[i], v)


class ReferenceAdam(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` around :func:`reference_adam_step` (per-group hyper-parameters, closures).

    State per parameter: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (fp32; fp64 for fp64 params).
    Parameters without a gradient are skipped.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = run_closure(closure)
        for group in self.param_groups:
            ps, gs, ms, vs, steps = adam_moments(self.state, group)
            beta1, beta2 = group["betas"]
            reference_adam_step(
                ps,
                gs,
                ms,
                vs,
                steps,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adamw_mode=group["adamw_mode"],
                bias_correction=group["bias_correction"],
                maximize=group["maximize"],
            )
            for p, t in zip(ps, steps, strict=True):
                self.state[p]["step"] = t
        return loss
