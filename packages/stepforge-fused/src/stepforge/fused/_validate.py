# SPDX-License-Identifier: Apache-2.0
"""Hyper-parameter checks shared by the fused optimizers (messages come from stepforge.core)."""

from __future__ import annotations

from typing import Any

from stepforge.core import (
    HyperParameterError,
    check_betas,
    check_bool,
    check_eps,
    check_lr,
    check_weight_decay,
)

__all__ = ["check_adam_like", "reject_legacy_step_args"]


def check_adam_like(
    owner: str, *, lr: Any, betas: Any, eps: Any, weight_decay: Any, amsgrad: Any, flags: dict[str, Any]
) -> None:
    """Validate the Adam/LAMB family options; ``amsgrad=True`` raises a clear error."""
    check_lr(lr, owner=owner)
    check_betas(betas, owner=owner)
    check_eps(eps, owner=owner)
    check_weight_decay(weight_decay, owner=owner)
    check_bool("amsgrad", amsgrad, owner=owner)
    if amsgrad:
        raise HyperParameterError(
            f"{owner}: amsgrad=True is not supported by the fused kernels. Use torch.optim.AdamW(amsgrad=True) "
            "or pass amsgrad=False."
        )
    for name, value in flags.items():
        check_bool(name, value, owner=owner)


def reject_legacy_step_args(owner: str, **legacy: Any) -> None:
    """apex/ColossalAI step() keeps grads/output_params/scale/grad_norms for compatibility; they must be None."""
    for name, value in legacy.items():
        if value is not None:
            raise TypeError(
                f"{owner}.step(): the legacy argument {name!r} is not supported (it must be None); gradients are "
                "read from p.grad, and a loss scale is passed as div_scale= or through torch.amp.GradScaler."
            )
