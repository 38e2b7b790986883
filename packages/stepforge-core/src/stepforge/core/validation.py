# SPDX-License-Identifier: Apache-2.0
"""Hyper-parameter and gradient validation with messages that name the parameter and the allowed range.

Every optimizer of stepforge validates through these helpers, so a bad value reads the same everywhere::

    >>> check_lr(-1.0, owner="FusedAdam")
    Traceback (most recent call last):
    ...
    HyperParameterError: FusedAdam: invalid lr=-1.0; lr must be in [0, inf). Pass a non-negative learning rate.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from .errors import HyperParameterError

__all__ = [
    "check_range",
    "check_lr",
    "check_eps",
    "check_weight_decay",
    "check_momentum",
    "check_dampening",
    "check_beta",
    "check_betas",
    "check_positive_int",
    "check_bool",
    "check_grad",
    "check_float_dtype",
    "check_nesterov",
    "check_trust_clip",
    "GroupValidator",
    "validate_hyperparameters",
]


def _prefix(owner: str | None) -> str:
    return f"{owner}: " if owner else ""


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    left = "(" if (low is None or low_open) else "["
    right = ")" if (high is None or high_open) else "]"
    lo = "-inf" if low is None else f"{low:g}"
    hi = "inf" if high is None else f"{high:g}"
    return f"{left}{lo}, {hi}{right}"


def check_range(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    owner: str | None = None,
    hint: str = "",
) -> float:
    """``value`` (a Python number or a one-element tensor, for tensor ``lr``) as a float, checked to lie between
    ``low`` and ``high`` (``None``: unbounded; ``*_open``: the bound itself excluded); else a
    :class:`HyperParameterError` naming ``owner`` and ``name`` as the user spells it (``"betas[0]"``), ending
    with ``hint``, how to fix it."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise HyperParameterError(
                f"{_prefix(owner)}invalid {name}: a tensor {name} must hold one element, got shape "
                f"{tuple(value.shape)}."
            )
        number = float(value.detach().cpu().item())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise HyperParameterError(
            f"{_prefix(owner)}invalid {name}={value!r}; {name} must be a real number, got "
            f"{type(value).__name__}."
        )
    inside = not math.isnan(number)
    if inside and low is not None:
        inside = number > low if low_open else number >= low
    if inside and high is not None:
        inside = number < high if high_open else number <= high
    if not inside:
        interval = _interval(low, high, low_open, high_open)
        message = f"{_prefix(owner)}invalid {name}={value!r}; {name} must be in {interval}."
        raise HyperParameterError(f"{message} {hint}".rstrip())
    return number


def check_lr(lr: Any, *, owner: str | None = None) -> float:
    """``lr`` in ``[0, inf)``; a 0-dim tensor is accepted (CUDA-graph capturable optimizers)."""
    return check_range("lr", lr, low=0.0, owner=owner, hint="Pass a non-negative learning rate.")


def check_eps(eps: Any, *, owner: str | None = None, name: str = "eps") -> float:
    """``eps`` in ``[0, inf)``."""
    return check_range(name, eps, low=0.0, owner=owner, hint=f"Pass a small non-negative {name}, e.g. 1e-8.")


def check_weight_decay(weight_decay: Any, *, owner: str | None = None) -> float:
    """``weight_decay`` in ``[0, inf)``."""
    return check_range(
        "weight_decay", weight_decay, low=0.0, owner=owner, hint="Use 0 to disable weight decay."
    )


def check_momentum(momentum: Any, *, owner: str | None = None) -> float:
    """``momentum`` in ``[0, inf)``, as ``torch.optim.SGD`` accepts."""
    return check_range("momentum", momentum, low=0.0, owner=owner, hint="Use 0 to disable momentum.")


def check_dampening(dampening: Any, *, owner: str | None = None) -> float:
    """``dampening`` in ``[0, 1]``."""
    return check_range("dampening", dampening, low=0.0, high=1.0, owner=owner)


def check_beta(name: str, beta: Any, *, owner: str | None = None) -> float:
    """One Adam/LAMB beta in ``[0, 1)``."""
    return check_range(
        name, beta, low=0.0, high=1.0, high_open=True, owner=owner, hint="Betas are decay rates in [0, 1)."
    )


def check_betas(betas: Any, *, owner: str | None = None) -> tuple[float, float]:
    """A pair ``(beta1, beta2)``, each in ``[0, 1)``."""
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise HyperParameterError(
            f"{_prefix(owner)}invalid betas={betas!r}; betas must be a pair (beta1, beta2), e.g. (0.9, 0.999)."
        )
    return check_beta("betas[0]", betas[0], owner=owner), check_beta("betas[1]", betas[1], owner=owner)


def check_positive_int(name: str, value: Any, *, owner: str | None = None) -> int:
    """An ``int`` that is at least 1 (counts, world sizes, window lengths)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise HyperParameterError(
            f"{_prefix(owner)}invalid {name}={value!r}; {name} must be an integer >= 1."
        )
    return int(value)


def check_bool(name: str, value: Any, *, owner: str | None = None) -> bool:
    """A real ``bool`` (catches ``adamw_mode="False"`` and similar config mistakes)."""
    if not isinstance(value, bool):
        raise HyperParameterError(f"{_prefix(owner)}invalid {name}={value!r}; {name} must be True or False.")
    return value


def check_grad(param: torch.Tensor, *, owner: str | None = None, allow_sparse: bool = False) -> None:
    """Reject (:class:`HyperParameterError`, naming the fix) a gradient that is sparse, or of another shape or
    device than ``param``."""
    grad = param.grad
    if grad is None:
        return
    if grad.is_sparse and not allow_sparse:
        raise HyperParameterError(
            f"{_prefix(owner)}got a sparse gradient for a parameter of shape {tuple(param.shape)}; this "
            "optimizer needs dense gradients. Use torch.optim.SparseAdam for sparse embeddings, or build the "
            "embedding with sparse=False."
        )
    if grad.shape != param.shape:
        raise HyperParameterError(
            f"{_prefix(owner)}gradient shape {tuple(grad.shape)} does not match parameter shape "
            f"{tuple(param.shape)}."
        )
    if grad.device != param.device:
        raise HyperParameterError(
            f"{_prefix(owner)}gradient on {grad.device} but parameter on {param.device}; move both to one "
            "device."
        )


def check_float_dtype(
    name: str,
    tensor: torch.Tensor,
    *,
    allowed: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16),
    owner: str | None = None,
) -> None:
    """The tensor's dtype is one of ``allowed``."""
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise HyperParameterError(
            f"{_prefix(owner)}{name} has dtype {str(tensor.dtype).removeprefix('torch.')}; supported dtypes "
            f"are {names}. Convert it with .to(torch.float32) or use torch.optim for other dtypes."
        )


_CHECKS: dict[str, Callable[..., Any]] = {
    "lr": check_lr,
    "eps": check_eps,
    "weight_decay": check_weight_decay,
    "momentum": check_momentum,
    "dampening": check_dampening,
    "betas": check_betas,
}


def validate_hyperparameters(values: Mapping[str, Any], *, owner: str | None = None) -> None:
    """Run the matching check on every known key of ``values`` (``lr``, ``eps``, ``betas``, ...).

    Unknown keys are left to the optimizer's own constructor.
    """
    for key, check in _CHECKS.items():
        if key in values and values[key] is not None:
            check(values[key], owner=owner)


def check_nesterov(nesterov: Any, momentum: Any, dampening: Any = 0, *, owner: str | None = None) -> bool:
    """``nesterov`` is a bool, and ``True`` only with ``momentum > 0`` and ``dampening == 0`` (torch.optim.SGD)."""
    check_bool("nesterov", nesterov, owner=owner)
    if nesterov and (not momentum > 0 or dampening != 0):
        raise HyperParameterError(
            f"{_prefix(owner)}nesterov=True requires momentum > 0 and dampening == 0 (got momentum={momentum!r}, "
            f"dampening={dampening!r}). Set a momentum (e.g. 0.9) or pass nesterov=False."
        )
    return bool(nesterov)


def check_trust_clip(
    value: Any, *, owner: str | None = None, name: str = "trust_clip"
) -> tuple[float | None, float | None] | None:
    """``None`` or a pair ``(low, high)`` of non-negative numbers (either may be ``None`` = unbounded), low <= high."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise HyperParameterError(
            f"{_prefix(owner)}invalid {name}={value!r}; pass a pair (low, high), e.g. (0.0, 10.0), or None for no "
            "clamp."
        )
    pair = tuple(value)
    if len(pair) != 2:
        raise HyperParameterError(
            f"{_prefix(owner)}invalid {name}={value!r}; pass exactly two bounds (low, high)."
        )
    bounds: list[float | None] = []
    for part, bound in zip(("low", "high"), pair, strict=True):
        if bound is None:
            bounds.append(None)
            continue
        if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or not float(bound) >= 0:
            raise HyperParameterError(
                f"{_prefix(owner)}invalid {name} {part} bound {bound!r}; bounds must be non-negative numbers or "
                "None."
            )
        bounds.append(float(bound))
    if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
        raise HyperParameterError(f"{_prefix(owner)}invalid {name}={value!r}; low must not exceed high.")
    return bounds[0], bounds[1]


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


class GroupValidator:
    """Validates an optimizer's param groups with ``check(group)`` (raises :class:`HyperParameterError`, may
    normalise values in place), where they enter and whenever one was edited.

    Every stepforge optimizer calls :meth:`validate` in ``__init__``/``add_param_group`` (and after
    ``load_state_dict``) and :meth:`revalidate` at the start of each ``step()``, which re-checks only groups
    whose hyper-parameters changed, so an edit such as ``opt.param_groups[0]["lr"] = -1`` fails at the next
    step, naming the group, instead of silently doing something else.
    """

    def __init__(self, check: Callable[[MutableMapping[str, Any]], Any], *, owner: str) -> None:
        self._check = check
        self._owner = owner
        self._seen: dict[int, tuple[MutableMapping[str, Any], list[tuple[str, Any]]]] = {}

    def validate(self, group: MutableMapping[str, Any], index: int | None = None) -> None:
        """Check ``group`` now (raises naming the group) and remember its values."""
        try:
            self._check(group)
        except HyperParameterError as exc:
            where = "" if index is None else f" (param group #{index})"
            raise HyperParameterError(f"{exc}{where}") from None
        self._seen[id(group)] = (group, [(k, v) for k, v in group.items() if k != "params"])

    def revalidate(self, groups: Sequence[MutableMapping[str, Any]]) -> None:
        """Re-check every group whose values changed since it was last checked (and groups never checked)."""
        for i, group in enumerate(groups):
            seen = self._seen.get(id(group))
            if seen is not None and seen[0] is group:
                old = seen[1]
                if len(old) == len(group) - ("params" in group) and all(
                    k in group and _same(group[k], v) for k, v in old
                ):
                    continue
            self.validate(group, i)

    def forget(self) -> None:
        """Drop every snapshot (after ``load_state_dict`` replaced the groups)."""
        self._seen.clear()
