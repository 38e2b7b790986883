# SPDX-License-Identifier: Apache-2.0
"""Reference LARS: a plain loop over parameters, in fp32 (fp64 for fp64 tensors).

Defaults reproduce ColossalAI's ``Lars`` (from NUS-HPC-AI-Lab LARS-ImageNet); ``dampening`` and ``nesterov``
follow ``torch.optim.SGD``. For every tensor ``i``::

    g = g / grad_scale ; g = -g if maximize
    r = eeta * ||p|| / (||g|| + wd * ||p|| + epsilon)   if adapt[i] and ||p|| > 0 and ||g|| > 0, else 1
    r = clamp(r, *trust_clip)                           # default (0, 50); None: no clamp
    d = g + wd * p
    d = clamp(d, -grad_clip, grad_clip)                 # element-wise, default 10; None: no clamp
    if momentum != 0:
        buf = d                      on the first step (buffer is None)
        buf = mu * buf + (1 - dampening) * d   otherwise
        d   = d + mu * buf if nesterov else buf
    p = p - lr * r * d

The ratio uses the norms of ``p`` and of the *undecayed* ``g`` and scales the post-momentum step (ColossalAI;
the LARS paper instead folds the local lr into the momentum). Note ColossalAI's ``lars=False`` groups skip
both the ratio *and* the weight decay: pass ``adapt=False`` and ``weight_decay=0`` for those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import Any

import torch

from ._util import check_lists, math_dtype_for, run_closure, to_math, write_back

__all__ = ["reference_lars_step", "ReferenceLars"]


@torch.no_grad()
def reference_lars_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: MutableSequence[torch.Tensor | None],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    eeta: float = 1e-3,
    weight_decay: float = 0.0,
    epsilon: float = 0.0,
    grad_clip: float | None = 10.0,
    trust_clip: tuple[float | None, float | None] | None = (0.0, 50.0),
    adapt: bool | Sequence[bool] = True,
    grad_scale: float = 1.0,
    maximize: bool = False,
    math_dtype: torch.dtype | None = None,
) -> None:
    """One LARS step on every tensor, in place (formulas in the module docstring).

    Args:
        params: parameters (any float dtype/device); updated in place.
        grads: gradients; read only.
        momentum_buffers: one entry per tensor; ``None`` entries are replaced by new buffers (fp32; fp64 for
            fp64 params) when ``momentum != 0``; existing buffers are updated in place.
        lr, momentum, dampening, nesterov: as ``torch.optim.SGD``.
        eeta: the LARS trust coefficient.
        weight_decay: L2 coefficient (enters both ``d`` and the ratio's denominator).
        epsilon: added to the ratio's denominator.
        grad_clip: element-wise clamp of ``d`` to ``[-grad_clip, grad_clip]``; ``None`` disables it.
        trust_clip: ``(low, high)`` for the ratio (either may be ``None``); ``None`` disables it.
        adapt: per tensor (or one bool for all), whether the trust ratio is used (``False``: ``r = 1``).
        grad_scale: the loss scale; gradients are divided by it first.
        maximize: ascend instead of descend.
        math_dtype: compute dtype (default fp32, fp64 for fp64 tensors).
    """
    n = check_lists(
        "reference_lars_step",
        params=params,
        grads=grads,
        momentum_buffers=momentum_buffers,
        adapt=None if isinstance(adapt, bool) else adapt,
    )
    for i in range(n):
        dtype = math_dtype_for(params[i], math_dtype)
        p = to_math(params[i], dtype)
        g = to_math(grads[i], dtype) / grad_scale
        if maximize:
            g = -g
        ratio = 1.0
        if adapt if isinstance(adapt, bool) else adapt[i]:
            w_norm = float(torch.linalg.vector_norm(p))
            g_norm = float(torch.linalg.vector_norm(g))
            if w_norm > 0 and g_norm > 0:
                ratio = eeta * w_norm / (g_norm + weight_decay * w_norm + epsilon)
            if trust_clip is not None:
                low, high = trust_clip
                ratio = ratio if low is None else max(ratio, low)
                ratio = ratio if high is None else min(ratio, high)
        d = g + weight_decay * p if weight_decay != 0 else g
        if grad_clip is not None:
            d = d.clamp(-grad_clip, grad_clip)
        if momentum != 0:
            existing = momentum_buffers[i]
            if existing is None:
                buf = d.clone()
                momentum_buffers[i] = buf.to(
                    torch.float64 if params[i].dtype == torch.float64 else torch.float32
                )
            else:
                buf = momentum * to_math(existing, dtype) + (1.0 - dampening) * d
                write_back(existing, buf)
            d = d + momentum * buf if nesterov else buf
        write_back(params[i], p - (lr * ratio) * d)


class ReferenceLars(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` around :func:`reference_lars_step`; defaults are ColossalAI ``Lars``'s.

    A group with ``lars=False`` (ColossalAI's group key) gets neither the ratio nor weight decay;
    ``exclude_from_adaptation(p) -> bool`` drops only the ratio for the parameters it selects.
    State per parameter: ``momentum_buffer`` (fp32; fp64 for fp64 params) when ``momentum != 0``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        eeta: float = 1e-3,
        weight_decay: float = 0.0,
        epsilon: float = 0.0,
        *,
        dampening: float = 0.0,
        nesterov: bool = False,
        grad_clip: float | None = 10.0,
        trust_clip: tuple[float | None, float | None] | None = (0.0, 50.0),
        exclude_from_adaptation: Callable[[torch.Tensor], bool] | None = None,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            eeta=eeta,
            weight_decay=weight_decay,
            epsilon=epsilon,
            dampening=dampening,
            nesterov=nesterov,
            grad_clip=grad_clip,
            trust_clip=trust_clip,
            lars=True,
            maximize=maximize,
        )
        self.exclude_from_adaptation = exclude_from_adaptation
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = run_closure(closure)
        exclude = self.exclude_from_adaptation
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            bufs: list[torch.Tensor | None] = [self.state[p].get("momentum_buffer") for p in ps]
            adapt = [bool(group["lars"]) and not (exclude is not None and exclude(p)) for p in ps]
            reference_lars_step(
                ps,
                [p.grad for p in ps],
                bufs,
                lr=group["lr"],
                momentum=group["momentum"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                eeta=group["eeta"],
                weight_decay=group["weight_decay"] if group["lars"] else 0.0,
                epsilon=group["epsilon"],
                grad_clip=group["grad_clip"],
                trust_clip=group["trust_clip"],
                adapt=adapt,
                maximize=group["maximize"],
            )
            if group["momentum"] != 0:
                for p, buf in zip(ps, bufs, strict=True):
                    self.state[p]["momentum_buffer"] = buf
        return loss
