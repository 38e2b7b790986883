# SPDX-License-Identifier: Apache-2.0
"""Gradient clipping for both APIs: the ``clip_grad`` config, checked where it enters, and one clip routine.

Clipping by norm goes through the optimizer when it is a :class:`stepforge.core.ClippingOptimizer`: AMP and ZeRO
optimizers keep *scaled* or *sharded* gradients, so only they can compute the true norm.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stepforge.core import BoostedOptimizer, ClippingOptimizer, HyperParameterError, check_range

__all__ = ["check_max_norm", "check_norm_type", "clip_grad_norm", "clip_grad_value", "parse_clip_grad"]

# the arguments of torch.nn.utils.clip_grad_{kind}_ (the first one is required)
_KEYS = {
    "norm": ("max_norm", "norm_type", "error_if_nonfinite", "foreach"),
    "value": ("clip_value", "foreach"),
}


def check_max_norm(max_norm: Any, *, owner: str, name: str = "max_norm") -> float:
    """``max_norm`` > 0 (``inf`` allowed: measure the norm, clip nothing)."""
    return check_range(
        name,
        max_norm,
        low=0.0,
        low_open=True,
        owner=owner,
        hint="A norm <= 0 would zero every gradient; pass a positive bound such as 1.0, or drop clip_grad.",
    )


def check_norm_type(norm_type: Any, *, owner: str, name: str = "norm_type") -> float:
    """``norm_type`` > 0 (``2.0``, ``1.0``, ``float('inf')``; the string ``'inf'`` too, as torch accepts)."""
    if isinstance(norm_type, str) and norm_type.strip().lower() == "inf":
        return math.inf
    return check_range(
        name, norm_type, low=0.0, low_open=True, owner=owner, hint="Use 2.0 (Euclidean), 1.0 or float('inf')."
    )


def parse_clip_grad(clip_grad: Any, *, owner: str) -> tuple[str, dict[str, Any]] | None:
    """Check mmengine's ``clip_grad`` dict (``None`` = no clipping) into ``(type, a copy of the arguments)``.

    Raises:
        TypeError: ``clip_grad`` is not a dict.
        HyperParameterError: unknown ``type``, a missing or unknown argument, ``max_norm <= 0``,
            ``norm_type <= 0``, ``clip_value <= 0``, or a non-numeric value.
    """
    if clip_grad is None:
        return None
    if not isinstance(clip_grad, Mapping):
        raise TypeError(
            f"{owner}: clip_grad must be a dict such as dict(type='norm', max_norm=1.0), got {clip_grad!r}."
        )
    kwargs = copy.deepcopy(dict(clip_grad))
    kind = kwargs.pop("type", "norm")
    if kind not in _KEYS:
        raise HyperParameterError(
            f"{owner}: invalid clip_grad type={kind!r}; clip_grad type must be 'norm' or 'value' "
            "(torch.nn.utils.clip_grad_norm_ / clip_grad_value_)."
        )
    required = _KEYS[kind][0]
    if not kwargs:
        raise HyperParameterError(
            f"{owner}: clip_grad needs the arguments of torch.nn.utils.clip_grad_{kind}_ besides 'type' "
            f"(e.g. dict(type={kind!r}, {required}=1.0))."
        )
    unknown = sorted(set(kwargs) - set(_KEYS[kind]))
    if unknown:
        raise HyperParameterError(
            f"{owner}: clip_grad has unknown argument(s) {unknown} for type={kind!r}; "
            f"torch.nn.utils.clip_grad_{kind}_ takes {sorted(_KEYS[kind])}."
        )
    if required not in kwargs:
        raise HyperParameterError(
            f"{owner}: clip_grad of type={kind!r} needs {required}=..., got {sorted(kwargs)}."
        )
    if kind == "norm":
        check_max_norm(kwargs["max_norm"], owner=owner, name="clip_grad['max_norm']")
        if "norm_type" in kwargs:
            check_norm_type(kwargs["norm_type"], owner=owner, name="clip_grad['norm_type']")
    else:
        check_range(
            "clip_grad['clip_value']",
            kwargs["clip_value"],
            low=0.0,
            low_open=True,
            owner=owner,
            hint="Gradients are clamped to [-clip_value, clip_value]; 0 or less would zero or flip them.",
        )
    for flag in ("error_if_nonfinite", "foreach"):
        if flag in kwargs and kwargs[flag] is not None and not isinstance(kwargs[flag], bool):
            raise HyperParameterError(
                f"{owner}: invalid clip_grad['{flag}']={kwargs[flag]!r}; it must be True or False."
            )
    return kind, kwargs


def _params_with_grad(optimizer: Any) -> list[torch.Tensor]:
    return [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if getattr(p, "requires_grad", True) and p.grad is not None
    ]


def clip_grad_norm(optimizer: Any, max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> Any:
    """Clip by the global norm (see the module doc); ``kwargs`` are ``torch.nn.utils.clip_grad_norm_``'s.

    Returns the total norm, or ``None`` when nothing has a gradient.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm a :class:`~stepforge.core.ClippingOptimizer` measured
            is inf or NaN.
    """
    if isinstance(optimizer, ClippingOptimizer):
        norm = optimizer.clip_grad_norm_(max_norm, norm_type)
        if kwargs.get("error_if_nonfinite") and not torch.isfinite(torch.as_tensor(norm)).all():
            raise RuntimeError(f"clip_grad: the total norm of order {norm_type} of the gradients is {norm}.")
        return norm
    params = _params_with_grad(optimizer)
    if not params:
        return None
    return nn.utils.clip_grad_norm_(params, max_norm, norm_type, **kwargs)


def clip_grad_value(optimizer: Any, clip_value: float, **kwargs: Any) -> None:
    """Clamp every gradient to ``[-clip_value, clip_value]``, unscaled first for a boosted optimizer."""
    if isinstance(optimizer, BoostedOptimizer):
        optimizer.unscale_()
    params = _params_with_grad(optimizer)
    if params:
        nn.utils.clip_grad_value_(params, clip_value, **kwargs)
