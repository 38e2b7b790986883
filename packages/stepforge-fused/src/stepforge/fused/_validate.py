# SPDX-License-Identifier: Apache-2.0
"""Input checks shared by the fused optimizers: the Adam family's options, ``step()``'s arguments, parameters at
construction, parameter/gradient pairs at bucket building."""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any

import torch

from stepforge.core import (
    HyperParameterError,
    check_betas,
    check_bool,
    check_lr,
    check_range,
    check_weight_decay,
)
from stepforge.core.torch_compat import dtensor_local

from . import _backend

__all__ = ["adam_defaults", "check_adam_group", "check_pair", "check_param", "div_scale_divisor"]


_NUMBERS = ("lr", "betas", "eps", "weight_decay")


def check_adam_group(group: MutableMapping[str, Any], *, owner: str, flags: tuple[str, ...]) -> None:
    """The Adam-family checks on one param group (``flags``: its boolean options); ``amsgrad=True`` raises a
    clear error."""
    check_lr(group["lr"], owner=owner)
    check_betas(group["betas"], owner=owner)
    check_range(
        "eps", group["eps"], low=0.0, low_open=True, owner=owner, hint="Pass a small positive eps, e.g. 1e-8."
    )
    check_weight_decay(group["weight_decay"], owner=owner)
    amsgrad = group.get("amsgrad", False)
    check_bool("amsgrad", amsgrad, owner=owner)
    if amsgrad:
        raise HyperParameterError(
            f"{owner}: amsgrad=True is not supported by the fused kernels. Use torch.optim.AdamW(amsgrad=True) "
            "or pass amsgrad=False."
        )
    for name in flags:
        if name in group:
            check_bool(name, group[name], owner=owner)


def adam_defaults(owner: str, *, amsgrad: Any = False, **options: Any) -> dict[str, Any]:
    """Validate the Adam-family options (``lr, bias_correction, betas, eps, weight_decay`` and the boolean ones,
    e.g. ``adamw_mode``) and return them as the group defaults (``amsgrad`` is checked, not kept)."""
    flags = tuple(k for k in options if k not in _NUMBERS)
    check_adam_group({**options, "amsgrad": amsgrad}, owner=owner, flags=flags)
    return {**options, "betas": tuple(options["betas"])}


def div_scale_divisor(owner: str, div_scale: float | None) -> float:
    """The host divisor given by ``step(div_scale=)``: ``-1`` (or None) is none; anything else must be positive
    and finite (``HyperParameterError`` otherwise, before the closure runs)."""
    if div_scale is None or div_scale == -1:
        return 1.0
    return check_range(
        "div_scale",
        div_scale,
        low=0.0,
        low_open=True,
        high=math.inf,
        high_open=True,
        owner=f"{owner}.step()",
        hint="It divides every gradient (a loss scale); pass -1 (the default) for no division.",
    )


def check_param(p: Any, index: int, *, owner: str) -> None:
    """Reject parameters the kernels cannot update in place, at construction (not at the first step)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{owner}: parameter #{index} is a {type(p).__name__}, not a tensor.")
    t = dtensor_local(p)
    where = f"parameter #{index} (shape {tuple(p.shape)}, {p.dtype}, {t.device})"
    _backend.dtype_code(t.dtype, what=where, owner=owner)
    if not t.is_contiguous():
        raise RuntimeError(
            f"{owner}: {where} is not contiguous; the kernels update memory in place and a copy would be "
            "silently lost. Make it contiguous before creating the optimizer "
            "(e.g. p.data = p.data.contiguous())."
        )


def check_pair(p: torch.Tensor, g: torch.Tensor, index: int, *, owner: str) -> None:
    """A parameter and its gradient as the kernels need them (dense, same device and shape, contiguous,
    float32/float16/bfloat16); raises naming the parameter and the fix."""
    where = f"parameter #{index} (shape {tuple(p.shape)}, {p.dtype}, {p.device})"
    if g.is_sparse or p.is_sparse:
        raise RuntimeError(f"{owner}: {where} has a sparse gradient; the fused kernels need dense gradients.")
    if g.device != p.device:
        raise RuntimeError(
            f"{owner}: {where} has its gradient on {g.device}; a parameter and its gradient must share a "
            "device (move the gradient, or the parameter)."
        )
    if g.shape != p.shape:
        raise RuntimeError(f"{owner}: {where} has a gradient of shape {tuple(g.shape)}; shapes must match.")
    if not p.is_contiguous():
        raise RuntimeError(
            f"{owner}: {where} is not contiguous; the kernels update memory in place and a copy would be "
            "silently lost. Make the parameter contiguous before creating the optimizer."
        )
    if not g.is_contiguous():
        raise RuntimeError(
            f"{owner}: the gradient of {where} is not contiguous (strides {g.stride()}); pass contiguous "
            "gradients (e.g. p.grad = p.grad.contiguous())."
        )
    if p.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{owner}: {where} is on {p.device}; only CPU and CUDA tensors are supported.")
    _backend.dtype_code(p.dtype, what=where, owner=owner)
    _backend.dtype_code(g.dtype, what=f"the gradient of {where}", owner=owner)
