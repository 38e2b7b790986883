# SPDX-License-Identifier: Apache-2.0
"""Reference LAMB: a plain loop over parameters, in fp32 (fp64 for fp64 tensors).

Defaults reproduce apex / ColossalAI ``FusedLAMB`` (``multi_tensor_lamb``); other options reproduce
ColossalAI's pure-torch ``Lamb`` and the other known variants. ``t`` is the tensor's step after the increment::

    G    = sqrt(sum_i ||g_i / grad_scale||^2)   # over every tensor passed (or ``global_grad_norm``)
    c    = G / max_grad_norm if max_grad_norm and G > max_grad_norm else 1
    g    = g / grad_scale / c                   # global grad-norm clipping (apex: before everything else)
    g    = -g                                   # only if maximize
    g    = g + wd * p                           # L2 mode only (adam_w_mode=False)
    b3   = 1 - beta1 if grad_averaging else 1
    m    = beta1 * m + b3 * g
    v    = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t       # 1, 1 when bias_correction=False
    bias_correction_mode="update"    (apex):        u = (m / bc1) / (sqrt(v / bc2) + eps);  s = 1
    bias_correction_mode="step_size" (ColossalAI):  u = m / (sqrt(v) + eps);               s = sqrt(bc2) / bc1
    u    = u + wd * p                           # AdamW mode only (decay is inside u, so inside the ratio)
    r    = ||p|| / ||u|| if ||p|| > 0 and ||u|| > 0 else 1      # ||p|| before the update
    r    = clamp(r, *trust_clip)                # only if trust_clip is given (never clamps the fallback 1)
    r    = 1 if adam or (wd == 0 and not use_nvlamb)
    p    = p - lr * s * r * u

apex ``FusedLAMB`` = defaults (``bias_correction=True``, ``"update"``, ``adam_w_mode=True``,
``grad_averaging=True``, ``max_grad_norm=1.0``, ``use_nvlamb=False``). ColossalAI ``Lamb`` =
``bias_correction=False`` (or ``"step_size"`` when on), ``use_nvlamb=True``, ``max_grad_norm=None``.

Unlike apex, ``max_grad_norm=None`` or ``0`` disables clipping (apex with 0 divides by ``G/0 = inf``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import Any, Literal

import torch

from ._util import adam_moments, advance_step, check_lists, math_dtype_for, run_closure, to_math, write_back

__all__ = ["reference_lamb_step", "reference_global_grad_norm", "ReferenceLamb"]


@torch.no_grad()
def reference_global_grad_norm(grads: Iterable[torch.Tensor], *, grad_scale: float = 1.0) -> float:
    """``sqrt(sum ||g / grad_scale||^2)`` over ``grads``, computed in fp64 and returned as a Python float."""
    total = 0.0
    for g in grads:
        total += float((g.detach().to(torch.float64) / grad_scale).pow(2).sum())
    return math.sqrt(total)


@torch.no_grad()
def reference_lamb_step(
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
    adam_w_mode: bool = True,
    grad_averaging: bool = True,
    bias_correction: bool = True,
    bias_correction_mode: Literal["update", "step_size"] = "update",
    max_grad_norm: float | None = 1.0,
    use_nvlamb: bool = False,
    trust_clip: tuple[float | None, float | None] | None = None,
    adam: bool = False,
    grad_scale: float = 1.0,
    global_grad_norm: float | None = None,
    maximize: bool = False,
    math_dtype: torch.dtype | None = None,
) -> None:
    """One LAMB step on every tensor, in place (formulas in the module docstring).

    Args:
        params: parameters (any float dtype/device); updated in place.
        grads: gradients; read only (apex writes the update into ``p.grad``; the reference does not).
        exp_avgs, exp_avg_sqs: moments (fp32 or the param dtype); updated in place.
        steps: steps taken so far per tensor (``int`` or 0-dim tensor), incremented in place before use.
        lr, beta1, beta2, eps, weight_decay: hyper-parameters.
        adam_w_mode: decay inside ``u`` (``True``) or L2 on the gradient (``False``).
        grad_averaging: ``b3 = 1 - beta1`` (``True``) or ``1``.
        bias_correction: use ``bc1``/``bc2``; ``bias_correction_mode`` says where (see above).
        max_grad_norm: global-norm clip threshold; ``None`` or ``<= 0`` disables it.
        use_nvlamb: apply the trust ratio even when ``weight_decay == 0``.
        trust_clip: ``(low, high)`` bounds for the computed ratio (either may be ``None``), or ``None``.
        adam: force the ratio to 1 (ColossalAI ``Lamb(adam=True)``).
        grad_scale: the loss scale; gradients are divided by it first.
        global_grad_norm: the already-unscaled global norm, when it spans more tensors than these (e.g. all
            param groups); default: computed from ``grads``.
        maximize: ascend instead of descend.
        math_dtype: compute dtype (default fp32, fp64 for fp64 tensors).
    """
    if bias_correction_mode not in ("update", "step_size"):
        raise ValueError(
            f"bias_correction_mode must be 'update' or 'step_size', got {bias_correction_mode!r}"
        )
    n = check_lists(
        "reference_lamb_step",
        params=params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        steps=steps,
    )
    clip = 1.0
    if max_grad_norm is not None and max_grad_norm > 0:
        norm = (
            reference_global_grad_norm(grads, grad_scale=grad_scale)
            if global_grad_norm is None
            else float(global_grad_norm)
        )
        if norm > max_grad_norm:
            clip = norm / max_grad_norm
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    adapt = not adam and (weight_decay != 0 or use_nvlamb)
    for i in range(n):
        dtype = math_dtype_for(params[i], math_dtype)
        p, m, v = to_math(params[i], dtype), to_math(exp_avgs[i], dtype), to_math(exp_avg_sqs[i], dtype)
        g = to_math(grads[i], dtype) / grad_scale / clip
        if maximize:
            g = -g
        t = advance_step(steps, i)
        if not adam_w_mode and weight_decay != 0:
            g = g + weight_decay * p
        m = beta1 * m + beta3 * g
        v = beta2 * v + (1.0 - beta2) * g * g
        bc1 = 1.0 - beta1**t if bias_correction else 1.0
        bc2 = 1.0 - beta2**t if bias_correction else 1.0
        if bias_correction_mode == "update":
            u = (m / bc1) / (torch.sqrt(v / bc2) + eps)
            scale = 1.0
        else:
            u = m / (torch.sqrt(v) + eps)
            scale = math.sqrt(bc2) / bc1
        if adam_w_mode and weight_decay != 0:
            u = u + weight_decay * p
        ratio = 1.0
        if adapt:
            w_norm = float(torch.linalg.vector_norm(p))
            u_norm = float(torch.linalg.vector_norm(u))
            if w_norm > 0 and u_norm > 0:
                ratio = w_norm / u_norm
                if trust_clip is not None:
                    low, high = trust_clip
                    ratio = ratio if low is None else max(ratio, low)
                    ratio = ratio if high is None else min(ratio, high)
        write_back(params[i], p - (lr * scale * ratio) * u)
        write_back(exp_avgs[i], m)
        write_back(exp_avg_sqs[i], v)


class ReferenceLamb(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` around :func:`reference_lamb_step`; defaults are apex ``FusedLAMB``'s.

    The global gradient norm spans all param groups and uses the optimizer-level ``max_grad_norm`` (as apex).
    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (fp32; fp64 for fp64 params).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        bias_correction: bool = True,
        bias_correction_mode: Literal["update", "step_size"] = "update",
        max_grad_norm: float | None = 1.0,
        use_nvlamb: bool = False,
        trust_clip: tuple[float | None, float | None] | None = None,
        adam: bool = False,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            bias_correction=bias_correction,
            bias_correction_mode=bias_correction_mode,
            use_nvlamb=use_nvlamb,
            trust_clip=trust_clip,
            adam=adam,
            maximize=maximize,
        )
        self.max_grad_norm = max_grad_norm
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = run_closure(closure)
        all_grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = reference_global_grad_norm(all_grads)
        for group in self.param_groups:
            ps, gs, ms, vs, steps = adam_moments(self.state, group)
            beta1, beta2 = group["betas"]
            reference_lamb_step(
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
                adam_w_mode=group["adam_w_mode"],
                grad_averaging=group["grad_averaging"],
                bias_correction=group["bias_correction"],
                bias_correction_mode=group["bias_correction_mode"],
                max_grad_norm=self.max_grad_norm,
                use_nvlamb=group["use_nvlamb"],
                trust_clip=group["trust_clip"],
                adam=group["adam"],
                global_grad_norm=norm,
                maximize=group["maximize"],
            )
            for p, t in zip(ps, steps, strict=True):
                self.state[p]["step"] = t
        return loss
