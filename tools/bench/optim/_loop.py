# SPDX-License-Identifier: Apache-2.0
"""Per-parameter-loop LAMB and LARS: the baseline that ``bench_optim.py`` compares stepforge.optim against.

The same math as ``stepforge.optim.Lamb`` / ``Lars`` with default arguments (ColossalAI's ``Lamb`` and
``Lars``), written the way those libraries write it: one Python iteration per parameter, ordinary in-place
torch ops, and the trust ratio taken to the host with ``.item()``. State is kept in fp32 like stepforge's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["LoopLamb", "LoopLars"]


class LoopLamb(torch.optim.Optimizer):
    """ColossalAI-style LAMB (no bias correction, ratio always applied, no clipping), one tensor at a time."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                weight_norm = p.norm()
                update = exp_avg / exp_avg_sq.sqrt().add(group["eps"])
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                update_norm = update.norm()
                ratio = (weight_norm / update_norm).item() if weight_norm > 0 and update_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * ratio)
        return None


class LoopLars(torch.optim.Optimizer):
    """ColossalAI-style LARS (ratio clamp [0, 50], element clamp 10), one tensor at a time."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        eeta: float = 1e-3,
        weight_decay: float = 0.0,
        epsilon: float = 0.0,
    ) -> None:
        super().__init__(
            params, dict(lr=lr, momentum=momentum, eeta=eeta, weight_decay=weight_decay, epsilon=epsilon)
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            wd, mu = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                w_norm, g_norm = p.norm(), p.grad.norm()
                ratio = torch.where(
                    (w_norm > 0) & (g_norm > 0),
                    group["eeta"] * w_norm / (g_norm + wd * w_norm + group["epsilon"]),
                    torch.ones_like(w_norm),
                ).clamp_(0.0, 50.0)
                d = p.grad.add(p, alpha=wd) if wd != 0 else p.grad
                d = torch.clamp(d, -10.0, 10.0)
                if mu != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = d.clone()
                    else:
                        state["momentum_buffer"].mul_(mu).add_(d)
                    d = state["momentum_buffer"]
                p.add_(d, alpha=-group["lr"] * ratio.item())
        return None
