# SPDX-License-Identifier: Apache-2.0
"""The contenders of every ``bench_fused_gpu.py`` case: torch's best paths (fused, foreach, the bf16 + fp32
master composition, a foreach LAMB), stepforge's raw kernels and stepforge's optimizer classes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu._cases import HP, LAMB_HP, Bundle
from bench.gpu._kernels import kernel_adam, kernel_lamb, kernel_sgd

__all__ = ["contenders", "foreach_lamb", "torch_mixed"]


def torch_mixed(b: Bundle) -> Callable[[], None]:
    """Best torch composition for bf16 params with fp32 masters: copy grads up, fused AdamW, copy params down."""
    ps = [p.detach() for p in b.params]
    masters = [p.float().requires_grad_() for p in ps]
    for mp in masters:
        mp.grad = torch.empty_like(mp)
    opt = torch.optim.AdamW(masters, fused=True, **HP)
    low_grads = [p.grad for p in b.params]
    master_grads = [mp.grad for mp in masters]
    md = [mp.detach() for mp in masters]

    def step() -> None:
        torch._foreach_copy_(master_grads, low_grads)
        opt.step()
        torch._foreach_copy_(ps, md)

    return step


def foreach_lamb(b: Bundle) -> Callable[[], None]:
    """LAMB with torch._foreach_* ops (apex FusedLAMB math), everything on the device."""
    ps = [p.detach() for p in b.params]
    gs = [p.grad for p in b.params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    b1, b2 = LAMB_HP["betas"]
    eps, wd, lr = LAMB_HP["eps"], LAMB_HP["weight_decay"], LAMB_HP["lr"]
    state = {"step": 0}

    def step() -> None:
        state["step"] += 1
        t = state["step"]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)))
        clip = torch.clamp(norm / LAMB_HP["max_grad_norm"], min=1.0)
        g = torch._foreach_div(gs, clip)
        torch._foreach_lerp_(m, g, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, 1 - b2)
        denom = torch._foreach_div(v, 1 - b2**t)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        u = torch._foreach_div(m, 1 - b1**t)
        torch._foreach_div_(u, denom)
        torch._foreach_add_(u, ps, alpha=wd)
        pn = torch.stack(torch._foreach_norm(ps))
        un = torch.stack(torch._foreach_norm(u))
        ratio = torch.where((pn > 0) & (un > 0), pn / un, torch.ones_like(pn)) * -lr
        torch._foreach_mul_(u, list(ratio.unbind(0)))
        torch._foreach_add_(ps, u)

    return step


def _stepforge_class(kind: str, b: Bundle, **extra: Any) -> Callable[[], None] | None:
    try:
        import stepforge.fused as fused

        if kind == "adam":
            opt = fused.FusedAdam(b.params, bias_correction=True, **HP)
        elif kind == "mixed":
            opt = fused.FusedAdam(b.params, bias_correction=True, master_weights=True, **HP, **extra)
        elif kind == "sgd":
            opt = fused.FusedSGD(b.params, lr=HP["lr"], momentum=0.9)
        else:
            opt = fused.FusedLAMB(b.params, **LAMB_HP)
        opt.step()
        return opt.step
    except Exception as exc:  # the class may not route CUDA tensors in this build: report, do not abort
        print(f"  [skip] stepforge class for {kind}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def contenders(kind: str, shapes: list[tuple]) -> tuple[dict[str, Callable[[], None]], list, str]:
    dtype = torch.bfloat16 if kind == "mixed" else torch.float32
    bundles: list[Bundle] = []

    def fresh() -> Bundle:
        bundles.append(Bundle(shapes, dtype))
        return bundles[-1]

    fns: dict[str, Callable[[], None]] = {}
    if kind == "adam":
        fns["torch AdamW fused"] = torch.optim.AdamW(fresh().params, fused=True, **HP).step
        fns["torch AdamW foreach"] = torch.optim.AdamW(fresh().params, foreach=True, **HP).step
        fns["stepforge _cuda.adam"] = kernel_adam(fresh(), masters=False)
        baseline = "torch AdamW fused"
    elif kind == "mixed":
        fns["torch bf16->fp32 + AdamW fused"] = torch_mixed(fresh())
        fns["stepforge _cuda.adam (masters)"] = kernel_adam(fresh(), masters=True)
        baseline = "torch bf16->fp32 + AdamW fused"
    elif kind == "sgd":
        fns["torch SGD fused"] = torch.optim.SGD(fresh().params, lr=HP["lr"], momentum=0.9, fused=True).step
        fns["torch SGD foreach"] = torch.optim.SGD(
            fresh().params, lr=HP["lr"], momentum=0.9, foreach=True
        ).step
        fns["stepforge _cuda.sgd"] = kernel_sgd(fresh())
        baseline = "torch SGD fused"
    else:
        fns["torch foreach LAMB"] = foreach_lamb(fresh())
        fns["stepforge _cuda.lamb"] = kernel_lamb(fresh())
        baseline = "torch foreach LAMB"
    cls = _stepforge_class(kind, fresh())
    if cls is not None:
        fns[f"stepforge {'FusedAdam' if kind in ('adam', 'mixed') else 'Fused' + kind.upper()}"] = cls
    if kind == "mixed":  # the default overflow pre-check is a pass over the grads: its cost, measured apart
        unchecked = _stepforge_class(kind, fresh(), skip_nonfinite=False)
        if unchecked is not None:
            fns["stepforge FusedAdam skip_nonfinite=False"] = unchecked
    return fns, bundles, baseline
