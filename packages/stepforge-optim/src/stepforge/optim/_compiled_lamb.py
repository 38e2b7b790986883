# SPDX-License-Identifier: Apache-2.0
""":class:`Lamb` under ``torch.compile``: ``_init_group`` (run eagerly by dynamo) and the traced update.

The math is the eager update's (:class:`~._lamb.Lamb` docstring) on whole tensors, in the same order, with the
bias corrections computed in float64 from the step tensors (the eager step computes them in Python floats).
Inductor fuses the element-wise passes; its float32 arithmetic rounds each operation like the eager
``torch._foreach_*`` calls except where ATen contracts a multiply-add, so parameters after 10 steps agree with
the eager step to a few ulp (the bound the tests hold it to is in ``tests/test_compiled.py``).

Memory: the update ``u`` is written as per-tensor element-wise expressions and norms, not ``torch._foreach_*``
(inductor realises every foreach output as a buffer), so inductor computes it inside the norm's loop and again
inside the update's: the compiled step holds no ``u`` at all (the eager step holds one segment's), measured on
tensors larger than a segment by ``test_compiled_lamb_keeps_no_update_buffer``.
"""

from __future__ import annotations

from typing import Any

import torch

from ._base import math_dtype_of
from ._compiled import as_step_tensor, group_params
from ._multi_tensor import bucket_key

__all__ = ["lamb_compiled_step", "lamb_init_group"]


def lamb_init_group(
    opt: Any,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> tuple[tuple[int, int], ...]:
    """Fill the lists with ``group``'s parameters that have a gradient (their state created as the eager step
    creates it, ``step`` as a tensor), bucket by bucket; returns each bucket's ``(start, stop)``."""
    opt._groups.revalidate(opt.param_groups)
    by_key: dict[Any, list[torch.Tensor]] = {}
    for p in group_params(opt.OWNER, group):
        state = opt.state[p]
        if "step" not in state:
            sdtype = math_dtype_of(p.dtype)
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=sdtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=sdtype, memory_format=torch.contiguous_format)
        state["step"] = as_step_tensor(state["step"], p.device)
        by_key.setdefault(bucket_key(p, p.grad), []).append(p)  # type: ignore[arg-type]
    plan = []
    for ps in by_key.values():
        start = len(params)
        for p in ps:
            state = opt.state[p]
            params.append(p)
            grads.append(p.grad)  # type: ignore[arg-type]
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        plan.append((start, len(params)))
    return tuple(plan)


def _global_clip(opt: Any, grad_lists: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """``max(1, ||G|| / max_grad_norm)`` over every bucket, as the eager ``Lamb._global_clip``."""
    max_norm = opt.defaults["max_grad_norm"]
    if not max_norm or not grad_lists:
        return None
    squares = []
    device = grad_lists[0][0].device
    for grads in grad_lists:
        norms = torch._foreach_norm(grads, 2, dtype=math_dtype_of(grads[0].dtype))
        squares.append(torch.stack(list(norms)).square().sum().to(device))
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
    total = torch.stack([s.to(dtype) for s in squares]).sum().sqrt()
    return torch.clamp(total / max_norm, min=1.0)


def lamb_compiled_step(opt: Any) -> None:
    """The traced update of every group (see the module docstring)."""
    work = []
    for group in opt.param_groups:
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        plan = opt._init_group(group, params, grads, exp_avgs, exp_avg_sqs, steps)
        for start, stop in plan:
            lists = (params[start:stop], grads[start:stop], exp_avgs[start:stop], exp_avg_sqs[start:stop])
            work.append((group, lists, steps[start:stop]))
    clip = _global_clip(opt, [lists[1] for _group, lists, _steps in work])
    for group, lists, steps in work:
        _update(group, *lists, steps, clip)


def _update(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    clip: torch.Tensor | None,
) -> None:
    mdtype = math_dtype_of(params[0].dtype)
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    adam_w, mode, bias_correction = (
        group["adam_w_mode"],
        group["bias_correction_mode"],
        group["bias_correction"],
    )
    b3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
    adapt = not group["adam"] and (wd != 0 or group["always_adapt"])
    torch._foreach_add_(steps, 1.0)
    p32 = [p.to(mdtype) for p in params]
    g = [x.to(mdtype) for x in grads]  # read only: every op on g below is out of place
    if clip is not None:
        g = list(torch._foreach_div(g, clip.to(mdtype)))
    if group["maximize"]:
        g = list(torch._foreach_neg(g))
    if not adam_w and wd != 0:
        g = list(torch._foreach_add(g, p32, alpha=wd))
    if group["grad_averaging"]:
        torch._foreach_lerp_(exp_avgs, g, b3)
    else:
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, g, alpha=b3)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1.0 - beta2)
    # bias corrections in float64 per tensor, as the eager step's Python floats
    t = torch.stack(steps).to(torch.float64)
    one = torch.ones_like(t)
    bc1 = 1.0 - beta1**t if bias_correction else one
    bc2 = 1.0 - beta2**t if bias_correction else one
    if mode == "update" and bias_correction:
        c2, c1 = bc2.to(mdtype), bc1.to(mdtype)
        denom = [(v / c2[i]).sqrt() + eps for i, v in enumerate(exp_avg_sqs)]
        u = [(m / c1[i]) / denom[i] for i, m in enumerate(exp_avgs)]
        scale = one
    else:
        u = [m / (v.pow(0.5) + eps) for m, v in zip(exp_avgs, exp_avg_sqs, strict=True)]
        scale = bc2.sqrt() / bc1 if mode == "step_size" else one
    if adam_w and wd != 0:
        u = [x + p * wd for x, p in zip(u, p32, strict=True)]
    lr64 = lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr
    factor = (-lr64 * scale).to(mdtype)
    coef = factor
    if adapt:
        w = torch.stack(list(torch._foreach_norm(p32)))
        # per-tensor element-wise expressions and norms (no _foreach_*: inductor realises every foreach output),
        # so inductor computes u inside the norm's loop and again inside the update's instead of keeping it
        n = torch.stack([torch.linalg.vector_norm(x) for x in u])
        ratio = torch.where((w > 0) & (n > 0), w / n, torch.ones_like(w))
        low, high = group["trust_clip"] or (None, None)
        if low is not None or high is not None:
            ratio = torch.where((w > 0) & (n > 0), ratio.clamp(min=low, max=high), ratio)
        coef = ratio * factor
    for i, p in enumerate(params):
        p.copy_(p32[i] + u[i] * coef[i])
